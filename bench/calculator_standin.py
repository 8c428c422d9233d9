"""The stand-in engine of `harnessrl bench load`: answers the calculator harness like a model.

It is a stand-in, not an engine, on purpose: a real engine (even the tiny demo model) would
make the bench measure the model, while the bench is there to measure the gateway carrying
hundreds of concurrent episodes. Each answer costs well under a millisecond of CPU.

It speaks the dialect the gateway asks of any engine (vLLM's): asked `return_token_ids`, it
answers top-level `prompt_token_ids` and per-choice `token_ids`; asked `logprobs`, one
`logprobs.content[]` entry per completion token; every answer names its policy version in
`x-policy-version`. Asked neither (the bench's baseline, where the harness calls it directly),
it answers as the OpenAI API does. Token ids are the bytes of the JSON of the messages
(prompt) and of the reply (completion): deterministic, and growing with the conversation.

It plays the calculator agent (examples/calculator): its first reply in an episode is a
`calculator` tool call on the question's expression; then, depending on the question (a hash,
so episodes differ but a question always plays out the same), it checks the result with the
inverse operation and recomputes it once more; last, it answers in words. An episode takes
two, three or four calls (the harness allows four).
"""

from __future__ import annotations

import asyncio
import re
import signal
import zlib
from typing import Any

import orjson

MODEL = "calculator-standin"
POLICY_VERSION = "1"
_NUMBER = re.compile(r"\d+")
_OPERATIONS = (
    ("+", (" + ", "plus", "add ")),
    ("-", (" - ", "minus", "subtract ")),
    ("*", (" * ", "times", "multiply ")),
    ("/", (" / ", "divided", "divide ")),
)
_INVERSE = {"+": "-", "-": "+", "*": "/", "/": "*"}
_LOGPROBS = [
    {"token": chr(b), "logprob": -0.125, "bytes": [b], "top_logprobs": []} for b in range(256)
]


def expression(question: str) -> tuple[str, str, str] | None:
    """(a, operator, b) of a calculator task's question, or None when it is not one."""
    numbers = _NUMBER.findall(question)
    if len(numbers) != 2:
        return None
    a, b = numbers
    text = question.lower()
    for operator, words in _OPERATIONS:
        if any(word in text for word in words):
            return (b, operator, a) if text.startswith("subtract") else (a, operator, b)
    return None


def reply(messages: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """(final answer, None) or (None, calculator expression) for a conversation so far."""
    question = next((str(m.get("content")) for m in messages if m.get("role") == "user"), "")
    parsed = expression(question)
    if parsed is None:
        return "I can only do arithmetic.", None
    a, operator, b = parsed
    results = [str(m.get("content")) for m in messages if m.get("role") == "tool"]
    checks = zlib.crc32(question.encode()) % 3  # tool calls after the first one
    if not results:
        return None, f"{a} {operator} {b}"
    if len(results) == 1 and checks >= 1:
        return None, f"{results[0]} {_INVERSE[operator]} {b}"
    if len(results) == 2 and checks == 2:
        return None, f"{a}{operator}{b}"
    return f"{a} {operator} {b} = {results[0]}. The answer is {results[0]}.", None


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The chat completion (a JSON object) for a chat completions request body."""
    messages = request.get("messages") or []
    content, calculation = reply(messages)
    message: dict[str, Any]
    if calculation is None:
        message = {"role": "assistant", "content": content}
        text, finish = content or "", "stop"
    else:
        arguments = orjson.dumps({"expression": calculation}).decode()
        call_id = f"call_{len(messages)}_{zlib.crc32(arguments.encode()):08x}"
        function = {"name": "calculator", "arguments": arguments}
        message = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        }
        text = f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'
        finish = "tool_calls"
    prompt, completion = orjson.dumps(messages), text.encode()
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": finish,
        "logprobs": None,
    }
    body: dict[str, Any] = {
        "id": f"chatcmpl-{zlib.crc32(prompt):08x}",
        "object": "chat.completion",
        "created": 0,
        "model": request.get("model") or MODEL,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(completion),
            "total_tokens": len(prompt) + len(completion),
        },
    }
    if request.get("return_token_ids") is True:
        body["prompt_token_ids"] = list(prompt)
        choice["token_ids"] = list(completion)
    if request.get("logprobs") is True:
        choice["logprobs"] = {"content": [_LOGPROBS[b] for b in completion]}
    return body


def serve(port: int) -> None:
    """Serve on 127.0.0.1:`port` until terminated (the entry point of its own process).
    Ctrl-C is left to the parent, which terminates it after its last call."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from harnessrl.bench.load_driver import run_loop
    from harnessrl.http import HttpServer, Request, Response, json_error

    json = ("content-type", "application/json")
    models = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def handle(request: Request) -> Response:
        if request.path == "/v1/models":
            return Response(200, [json], models)
        if request.path != "/v1/chat/completions" or request.method != "POST":
            return json_error(404, f"{request.method} {request.path}: not served")
        body = orjson.dumps(answer(orjson.loads(request.body)))
        return Response(200, [json, ("x-policy-version", POLICY_VERSION)], body)

    async def main() -> None:
        server = HttpServer(handle, host="127.0.0.1", port=port)
        await server.start()
        await asyncio.Event().wait()

    run_loop(main())
