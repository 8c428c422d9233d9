"""The gateway fuzzed from the OpenAPI document it serves, and with malformed HTTP on a raw
socket: a real gateway on the real broker (capture publishes), the tiny model behind it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio

from harnessrl.broker import EmbeddedBroker
from harnessrl.services.gateway.app import API_ROUTES
from harnessrl.services.gateway.openapi import document
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FULL
from tests.integration.fuzzing import anthropic_error_shape, fuzz, openai_error_shape, summary
from tests.integration.gateway_stack import Stack, running_stack
from tests.model_helpers import TINY
from tests.raw_http import exchange, first_response

pytestmark = pytest.mark.integration

EXAMPLES = 60 if FULL else 30
"""Requests per operation and generation mode (positive, negative); `make test-full` runs
the long version."""


@pytest_asyncio.fixture
async def stack(broker: EmbeddedBroker, tmp_path: Path) -> AsyncIterator[Stack]:
    # A short context keeps the valid requests that generate cheap on CPU.
    async with running_stack(
        broker, tmp_path, TINY, engine_settings={"max_model_len": 96}
    ) as running:
        yield running


def _prepare(case: Any, flip: bool) -> None:
    # Half of the OpenAI bodies are brought within what the project's engine requires where
    # the gateway's schema leaves it to the engine (content in every message, a prompt that
    # is a non-empty string, small whole counts), so that they reach generation and capture
    # rather than nearly all stopping at the engine's 400.
    body = case.body
    if not flip or not isinstance(body, dict) or case.path.startswith("/v1/messages"):
        return
    limits = {"n": (1, 4), "max_tokens": (1, 16), "max_output_tokens": (1, 16)}
    if case.path == "/v1/responses":
        body.pop("previous_response_id", None)  # none is stored: a 400 naming it
        if not (isinstance(body.get("input"), str) and body["input"].strip()):
            body["input"] = "hi"
    if case.path == "/v1/completions":
        limits["logprobs"] = (0, 5)
        if not (isinstance(body.get("prompt"), str) and body["prompt"].strip()):
            body["prompt"] = "hi"
    for name, (low, high) in limits.items():
        value = body.get(name)
        if value is not None and not (type(value) is int and low <= value <= high):
            body[name] = high
    for message in body.get("messages") or ():
        if isinstance(message, dict) and not isinstance(message.get("content"), str):
            message["content"] = "hi"


def _error_shape(path: str, body: Any) -> None:
    if "/v1/messages" in path:
        anthropic_error_shape(path, body)
    else:
        openai_error_shape(path, body)


async def test_the_openapi_document_needs_no_token_and_lists_exactly_the_routes_served(
    stack: Stack,
) -> None:
    auth = {"authorization": f"Bearer {stack.token()}"}
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        served = await http.get("/openapi.json")
        assert served.status_code == 200
        assert served.json() == document()
        paths = served.json()["paths"]
        assert {p: tuple(m.upper() for m in ops) for p, ops in paths.items()} == API_ROUTES
        for path, methods in API_ROUTES.items():
            other = "GET" if methods[0] != "GET" else "POST"
            for prefix, headers in [("", auth), (f"/e/{stack.token()}", {})]:
                wrong = await http.request(other, prefix + path, headers=headers)
                assert wrong.status_code in (404, 405), (prefix, path)
                _error_shape(path, wrong.json())
                for method in methods:
                    body = {} if method == "POST" else None
                    right = await http.request(method, prefix + path, headers=headers, json=body)
                    assert right.status_code in (200, 400, 404), (prefix, path, right.text)
                    if right.status_code != 200:
                        _error_shape(path, right.json())
        unknown = await http.post("/v1/embeddings", headers=auth, json={})
        assert unknown.status_code == 404
        openai_error_shape("/v1/embeddings", unknown.json())


async def test_no_generated_request_gets_a_5xx_and_every_error_is_in_the_routes_shape(
    stack: Stack,
) -> None:
    headers = {"authorization": f"Bearer {stack.token()}"}
    base = stack.gateway_url
    seen = await asyncio.to_thread(
        fuzz,
        f"{base}/openapi.json",
        base,
        examples=EXAMPLES,
        error_shape=_error_shape,
        headers=headers,
        prepare=_prepare,
    )
    print(summary(seen))
    answered = {k.rsplit(" ", 1)[0] for k in seen if k.endswith(" 200")}
    # A stored response's routes find none (the fuzzer knows no id): 404s, in shape.
    expected = {f"{m} {p}" for p, ms in API_ROUTES.items() for m in ms if "{id}/" not in p}
    expected -= {"GET /v1/responses/{id}", "DELETE /v1/responses/{id}"}
    assert answered == expected, summary(seen)
    async with httpx.AsyncClient(base_url=base, headers=headers) as http:
        assert (await http.get("/healthz")).status_code == 200
        answer = await http.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert answer.status_code == 200, answer.text
    # Capture kept up: every generating call answered 200 was published (one per choice).
    generated = sum(
        n
        for k, n in seen.items()
        if k.startswith("POST") and k.endswith(" 200") and "count_tokens" not in k
    )
    calls = await stack.calls(at_least=generated + 1)
    by_api = {name: sum(1 for c in calls if c.api == value) for name, value in pb.Api.items()}
    assert len(calls) >= generated + 1, (summary(seen), by_api)


async def test_lenient_booleans_the_engine_would_stream_on_get_a_400_not_a_500(
    stack: Stack,
) -> None:
    """Regression: `"stream": "true"` made the engine stream (its parser reads "true" as
    true) while the gateway waited for one JSON answer and failed on the SSE bytes (500)."""
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        for route, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"prompt": "hi"}),
        ]:
            answer = await http.post(
                route,
                headers={"authorization": f"Bearer {stack.token()}"},
                json={**body, "model": "m", "max_tokens": 2, "stream": "true"},
            )
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "stream"
    assert await stack.calls() == []


def _check_raw_answer(received: bytes, path: str) -> None:
    """Nothing (the connection closed) or a 4xx, in the route's error shape, never a 5xx."""
    response = first_response(received)
    if response is None:
        return
    status, body = response
    assert status < 500, received[:500]
    if status >= 400 and body:
        _error_shape(path, orjson.loads(body))


def _request(path: bytes, headers: list[bytes], body: bytes) -> bytes:
    """A POST with the episode token (`TOKEN`, replaced when sent) as its API key."""
    head = [b"POST " + path + b" HTTP/1.1", b"Host: gw", b"Authorization: Bearer TOKEN"]
    return b"\r\n".join([*head, *headers, b"", body])


CHAT = b"/v1/chat/completions"
MESSAGES = b"/v1/messages"
MALFORMED: dict[str, bytes] = {
    "content-length not a number": _request(CHAT, [b"Content-Length: abc"], b"{}"),
    "negative content-length": _request(CHAT, [b"Content-Length: -1"], b"{}"),
    "content-length with a sign": _request(MESSAGES, [b"Content-Length: +2"], b"{}"),
    "two content-lengths": _request(CHAT, [b"Content-Length: 2", b"Content-Length: 5"], b"{}xyz"),
    "content-length and chunked": _request(
        MESSAGES, [b"Content-Length: 5", b"Transfer-Encoding: chunked"], b"2\r\n{}\r\n0\r\n\r\n"
    ),
    "content-length under the body": _request(CHAT, [b"Content-Length: 1"], b'{"model": "m"}'),
    "huge content-length": _request(CHAT, [b"Content-Length: " + b"9" * 30], b"{}"),
    "invalid JSON": _request(CHAT, [b"Content-Length: 10"], b'{"model": '),
    "invalid JSON, anthropic": _request(MESSAGES, [b"Content-Length: 10"], b'{"model": '),
    "JSON not an object": _request(MESSAGES, [b"Content-Length: 7"], b"[1,2,3]"),
    "non-UTF-8 body": _request(b"/v1/completions", [b"Content-Length: 4"], b"\xff\xfe\xfd\xfc"),
    "non-UTF-8 in a JSON string": _request(
        MESSAGES, [b"Content-Length: 15"], b'{"model": "\xff\xfe"}'
    ),
    "lone surrogate escape": _request(CHAT, [b"Content-Length: 19"], b'{"model": "\\ud800"}'),
    "non-UTF-8 path": _request(b"/v1/\xff\xfe", [b"Content-Length: 2"], b"{}"),
    "percent-encoded non-UTF-8 path": _request(b"/v1/%ff%fe", [b"Content-Length: 2"], b"{}"),
    "NUL in a header value": _request(CHAT, [b"X-Thing: a\x00b", b"Content-Length: 2"], b"{}"),
    "non-UTF-8 API key": _request(MESSAGES, [b"X-Api-Key: \xff\xfe", b"Content-Length: 2"], b"{}"),
    "header without a colon": _request(CHAT, [b"Bogus", b"Content-Length: 2"], b"{}"),
    "huge header": _request(CHAT, [b"X-Big: " + b"a" * 100_000, b"Content-Length: 2"], b"{}"),
    "bad chunk size": _request(MESSAGES, [b"Transfer-Encoding: chunked"], b"zz\r\n{}\r\n0\r\n\r\n"),
    "chunk size overflow": _request(
        MESSAGES, [b"Transfer-Encoding: chunked"], b"ffffffffffffffffffff\r\n{}\r\n"
    ),
    "truncated body": _request(CHAT, [b"Content-Length: 100"], b'{"model": "m"'),
    "truncated chunked body": _request(MESSAGES, [b"Transfer-Encoding: chunked"], b"5\r\nab"),
    "unknown method": b"BREW /v1/messages HTTP/1.1\r\nHost: gw\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "binary request line": b"\x00\x01\x02\xff\r\n\r\n",
    "HTTP/0.9 request": b"GET /healthz\r\n",
    "bad absolute URL": b"POST http://[::1/v1/messages HTTP/1.1\r\nHost: gw\r\n\r\n",
    "very long URL": b"GET /v1/" + b"a" * 80_000 + b" HTTP/1.1\r\nHost: gw\r\n\r\n",
}


async def _serves(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        assert (await http.get("/healthz")).status_code == 200
        answer = await http.post(
            "/v1/completions",
            headers={"authorization": f"Bearer {stack.token()}"},
            json={"model": "m", "prompt": "hi", "max_tokens": 2},
        )
        assert answer.status_code == 200, answer.text


async def test_malformed_http_gets_a_4xx_or_a_closed_connection_and_the_gateway_serves_on(
    stack: Stack,
) -> None:
    port = int(stack.gateway_url.rsplit(":", 1)[1])
    token = stack.token().encode()
    for case, data in MALFORMED.items():
        # An error found in the request line (before the path) can only be the default
        # shape, OpenAI's; past it, the route's.
        line = data.split(b"\r\n")[0]
        routed = line.startswith((b"POST /", b"GET /")) and MESSAGES in line
        path = "/v1/messages" if routed else "/v1/chat/completions"
        received = await asyncio.to_thread(exchange, port, data.replace(b"TOKEN", token))
        try:
            _check_raw_answer(received, path)
        except AssertionError as err:
            raise AssertionError(f"{case}: {err}") from None
        await _serves(stack)
    assert await stack.calls() != []  # only the checks' own calls
