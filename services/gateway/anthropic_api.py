"""`/v1/messages`: Anthropic's Messages API, served through the engine's chat completions.

The request is translated to a chat completion (services/gateway/anthropic.py), forwarded
and captured exactly like an OpenAI chat call (so its ModelCall has the same exact ids), and
the answer is translated back, streamed as Anthropic's event sequence when asked.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from harnessrl.episode_token import EpisodeClaims
from harnessrl.http import Request, Response, StreamingResponse
from harnessrl.services.gateway.admin import json_response
from harnessrl.services.gateway.anthropic import (
    AnthropicError,
    MessageStream,
    chat_error_to_anthropic,
    chat_to_message,
    encode_sse,
    messages_to_chat,
)
from harnessrl.services.gateway.calls import Forwarder, StreamStart
from harnessrl.services.gateway.capture import CHAT
from harnessrl.v1 import events_pb2 as pb

_SSE = [("content-type", "text/event-stream"), ("cache-control", "no-cache")]


def error(
    status: int,
    message: str,
    param: str | None = None,
    headers: list[tuple[str, str]] | None = None,
) -> Response:
    """A response in Anthropic's error shape (`param` is folded into the message)."""
    text = f"{param}: {message}" if param else message
    return json_response(status, AnthropicError.for_status(status, text).body(), headers)


async def messages(
    forwarder: Forwarder, claims: EpisodeClaims, request: Request, body: dict[str, Any]
) -> Response | StreamingResponse:
    try:
        chat = messages_to_chat(body)
    except AnthropicError as err:
        return json_response(err.status, err.body())
    call = forwarder.call(
        claims,
        api=pb.API_ANTHROPIC_MESSAGES,
        kind=CHAT,
        path="/v1/chat/completions",
        body=chat.body,
        raw=request.body,
        traceparent=request.headers.get("traceparent"),
    )
    if not chat.stream:
        async with call:
            upstream = await call.complete()
        if upstream.data is None:
            return _engine_error(upstream.status, upstream.raw)
        return json_response(200, chat_to_message(upstream.data, model=chat.model))
    await call.__aenter__()
    chunks = call.chunks()
    try:
        start = await anext(chunks)
        assert isinstance(start, StreamStart)
        if start.error is not None:
            await _finish(call, chunks)
            code, translated = chat_error_to_anthropic(start.status, start.error)
            return json_response(code, translated)
    except BaseException:
        await _finish(call, chunks)
        raise
    translator = MessageStream(model=chat.model)

    async def sse() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                assert isinstance(chunk, dict)
                for event, data in translator.feed(chunk):
                    yield encode_sse(event, data)
            for event, data in translator.finish():
                yield encode_sse(event, data)
        finally:
            if call.outcome == "error":
                call.outcome = "aborted"
            await _finish(call, chunks)

    return StreamingResponse(200, list(_SSE), sse())


def _engine_error(status: int, raw: bytes) -> Response:
    try:
        parsed: object = orjson.loads(raw)
    except orjson.JSONDecodeError:
        parsed = {"error": {"message": raw.decode("utf-8", "replace")[:500]}}
    code, translated = chat_error_to_anthropic(status, parsed)
    return json_response(code, translated)


async def _finish(call: Any, chunks: AsyncIterator[Any]) -> None:
    await chunks.aclose()  # type: ignore[attr-defined]  # an async generator
    await call.__aexit__(None, None, None)
