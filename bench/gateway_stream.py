"""The streamed and Responses rows of `harnessrl bench gateway`.

Streaming is how coding agents always call (Codex, Claude Code), and completions run to
thousands of tokens, so the gateway's cost per streamed token matters as much as its cost per
call. The stand-in engine here streams vLLM-shaped chat chunks, one per token (token ids and
log-probs in each, as the gateway asks), `max_tokens` of them, pacing them `GAP_S` apart as
an engine's decode steps are (so chunks reach the gateway one by one, not coalesced); it
answers non-streamed requests with one canned completion. The load generator reads every
stream to its end. The gateway's CPU is read from /proc before and after each run: CPU per
call and per streamed token, at 50 and 2,000 tokens, is the figure the goal is stated in.
Every row is also run through a byte pipe (bench/pipe.py: bytes copied between sockets in
the event loop's callbacks, nothing parsed) to the same stand-in, its CPU read the same
way: the floor any proxy pays per call and per chunk on this machine (woken, one read, one
write). Each row reports the gateway's CPU, the pipe's, the gateway's CPU per streamed
token above the pipe's, and the row's CPU over the non-streamed call's in the same run.
`stream50_burst` sends its chunks with no gap (as an engine's do when the gateway falls
behind, or when a harness asks for a finished answer as a stream), so they reach the
gateway coalesced, several to a read: what the gateway costs then is mostly its own Python,
where paced chunks each cost a socket write and read, which on loopback includes the
receiving side's kernel work.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from harnessrl.bench.load_driver import measure as load
from harnessrl.bench.load_driver import run_loop

PROMPT_IDS = list(range(1000, 2000))
GAP_S = 0.001
"""Time between two chunks of one stream (an engine's decode step, much shortened)."""
CHAT = {"model": "bench", "messages": [{"role": "user", "content": "hi"}]}
RESPONSES = {"model": "bench", "input": "hi"}


def _chunk(index: int, token: int | None, *, finish: str | None = None) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": "x"}, "finish_reason": finish}
    if token is None:
        choice["delta"] = {"role": "assistant", "content": ""}
        choice["token_ids"] = []
        choice["logprobs"] = None
    else:
        choice["token_ids"] = [token]
        logprob = {"token": "x", "logprob": -0.25, "bytes": [120], "top_logprobs": []}
        choice["logprobs"] = {"content": [logprob]}
    chunk: dict[str, Any] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "bench",
        "choices": [choice],
    }
    if index == 0:
        chunk["prompt_token_ids"] = PROMPT_IDS
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def standin(port: int) -> None:
    """The stand-in engine (a child process): streams of `max_tokens` chunks, paced."""
    from harnessrl.bench.load_driver import canned
    from harnessrl.http import HttpServer, Response, StreamingResponse

    answer = canned()
    models = orjson.dumps({"object": "list", "data": [{"id": "bench", "object": "model"}]})
    first = _chunk(0, None)
    tokens = [_chunk(1, 100 + i % 64) for i in range(64)]
    last = _chunk(1, 7, finish="stop")
    usage = b"data: " + orjson.dumps({"id": "chatcmpl-bench", "choices": [], "usage": {}})
    headers = [("content-type", "text/event-stream"), ("x-policy-version", "3")]

    async def stream(n: int, gap_s: float) -> AsyncIterator[bytes]:
        yield first
        for i in range(n - 1):
            if gap_s:
                await asyncio.sleep(gap_s)
            yield tokens[i % 64]
        yield last + usage + b"\n\ndata: [DONE]\n\n"

    async def handle(request: Any) -> Response | StreamingResponse:
        if request.path == "/v1/models":
            return Response(200, [("content-type", "application/json")], models)
        if b'"stream":true' in request.body:  # only streams read their body
            body = orjson.loads(request.body)
            n, gap = body.get("max_tokens") or 50, body.get("gap_ms", GAP_S * 1000) / 1000
            return StreamingResponse(200, headers, stream(int(n), gap))
        return Response(200, [("content-type", "application/json"), headers[1]], answer)

    async def main() -> None:
        server = HttpServer(handle, host="127.0.0.1", port=port)
        await server.start()
        await asyncio.Event().wait()

    run_loop(main())


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(
    base: str, paths: list[str], body: dict[str, Any], seconds: float, pids: dict[str, int]
) -> dict[str, float]:
    """One run at concurrency 16; `<prefix>cpu_ms_per_call` for each process in `pids`."""
    before = {name: cpu_s(pid) for name, pid in pids.items()}
    result = load(base, paths, 16, seconds, body=orjson.dumps(body))
    for name, pid in pids.items():
        result[f"{name}cpu_ms_per_call"] = (
            (cpu_s(pid) - before[name]) * 1000 / max(1, result["calls"])
        )
    return result


def rows(
    direct: str,
    gateway: str,
    tokens: list[str],
    *,
    pid: int,
    engine_pid: int,
    pipe: tuple[str, int],
    seconds: float,
    rounds: int,
    log: Any,
) -> dict[str, Any]:
    """At concurrency 16: non-streamed chat (CPU per call), streams of 50 and 2,000 tokens,
    and the Responses API non-streamed and streamed, each against chat straight to the
    stand-in and through the byte pipe (`pipe`: its URL and process id). The gateway's CPU
    per call is printed beside the engine stand-in's (`engine_pid`) in the same runs: the
    stand-in only parses a request and writes a canned answer, a floor for any HTTP hop."""
    chat_direct = (direct, ["/v1/chat/completions"])
    chat_pipe = (pipe[0], ["/v1/chat/completions"])
    chat_gateway = (gateway, [f"/e/{t}/v1/chat/completions" for t in tokens])
    responses = (gateway, [f"/e/{t}/v1/responses" for t in tokens])
    cases = {
        "chat": ({**CHAT, "max_tokens": 64}, chat_gateway),
        "stream50": ({**CHAT, "stream": True, "max_tokens": 50}, chat_gateway),
        "stream50_burst": ({**CHAT, "stream": True, "max_tokens": 50, "gap_ms": 0}, chat_gateway),
        "stream2000": ({**CHAT, "stream": True, "max_tokens": 2000}, chat_gateway),
        "responses": ({**RESPONSES, "max_output_tokens": 64}, responses),
        "responses_stream50": ({**RESPONSES, "stream": True, "max_output_tokens": 50}, responses),
    }
    result: dict[str, Any] = {}
    chat_cpu = 1.0  # the first case's, "chat"
    for name, (body, through) in cases.items():
        chat_body: dict[str, Any] = {**CHAT, "stream": body.get("stream", False)}
        if "gap_ms" in body:
            chat_body["gap_ms"] = body["gap_ms"]
        chat_body["max_tokens"] = body.get("max_tokens") or body.get("max_output_tokens")
        runs: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": [], "pipe": []}
        for r in range(rounds):
            order = ("direct", "gateway", "pipe") if r % 2 == 0 else ("pipe", "gateway", "direct")
            for side in order:
                if side == "direct":
                    runs[side].append(_measure(*chat_direct, chat_body, seconds, {}))
                elif side == "pipe":
                    runs[side].append(_measure(*chat_pipe, chat_body, seconds, {"": pipe[1]}))
                else:
                    pids = {"": pid, "engine_": engine_pid}
                    runs[side].append(_measure(*through, body, seconds, pids))
        d = {k: statistics.median(x[k] for x in runs["direct"]) for k in ("p50_ms", "rps")}
        g = {
            k: statistics.median(x[k] for x in runs["gateway"])
            for k in ("p50_ms", "rps", "cpu_ms_per_call", "engine_cpu_ms_per_call")
        }
        floor = statistics.median(x["cpu_ms_per_call"] for x in runs["pipe"])
        n = int(chat_body["max_tokens"]) if body.get("stream") else 0
        result[f"{name}_added_p50_ms_c16"] = round(g["p50_ms"] - d["p50_ms"], 3)
        result[f"{name}_rps_direct_c16"] = round(d["rps"], 1)
        result[f"{name}_rps_gateway_c16"] = round(g["rps"], 1)
        result[f"{name}_throughput_ratio_c16"] = round(g["rps"] / d["rps"], 3)
        result[f"{name}_gateway_cpu_ms_per_call"] = round(g["cpu_ms_per_call"], 3)
        result[f"{name}_pipe_cpu_ms_per_call"] = round(floor, 3)
        result[f"{name}_engine_cpu_ms_per_call"] = round(g["engine_cpu_ms_per_call"], 3)
        result[f"{name}_gateway_cpu_over_engine"] = round(
            g["cpu_ms_per_call"] / max(g["engine_cpu_ms_per_call"], 1e-9), 2
        )
        if name == "chat":
            chat_cpu = g["cpu_ms_per_call"]
        result[f"{name}_cpu_over_chat"] = round(g["cpu_ms_per_call"] / chat_cpu, 2)
        if n:
            result[f"{name}_gateway_cpu_us_per_token"] = round(g["cpu_ms_per_call"] * 1000 / n, 2)
            above = (g["cpu_ms_per_call"] - floor) * 1000 / n
            result[f"{name}_gateway_cpu_us_per_token_above_pipe"] = round(above, 2)
        every = runs["gateway"] + runs["direct"] + runs["pipe"]
        result[f"{name}_errors"] = sum(x["errors"] for x in every)
        log(
            f"{name}: gateway {g['rps']:,.0f} calls/s p50 {g['p50_ms']:.2f} ms, "
            f"{g['cpu_ms_per_call']:.3f} ms CPU/call (pipe {floor:.3f}, engine stand-in "
            f"{g['engine_cpu_ms_per_call']:.3f}); direct "
            f"{d['rps']:,.0f} calls/s p50 {d['p50_ms']:.2f} ms"
        )
    return result
