"""`/v1/chat/completions` in vLLM's dialect: the prompt from the chat template, `n` choices,
an answer whole or streamed (SSE), tool calls parsed from the text, log-probs per token.

With `return_token_ids: true` the answer carries `prompt_token_ids` (top level, and in the
first stream chunk of each choice) and per-choice `token_ids` (in every stream chunk, even
when a tool call holds the text back).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import Response

from harnessrl.services.inference.codec import TextCodec
from harnessrl.services.inference.engine import EngineRequest, Token
from harnessrl.services.inference.engine_calls import (
    VERSION_HEADER,
    EngineCalls,
    OrjsonResponse,
    sse,
    usage,
)
from harnessrl.services.inference.generation import ChoiceOutput
from harnessrl.services.inference.protocol import ChatCompletionRequest


async def chat(calls: EngineCalls, body: ChatCompletionRequest) -> Response:
    """The chat completion `body` asks for (raises ApiError for a model not served or a
    prompt beyond the context)."""
    version = calls.check_model(body.model)
    prompt = calls.codec.chat_prompt(body.template_messages(), body.template_tools())
    limit = calls.token_limit(len(prompt), body.token_limit, "messages")
    tools = body.template_tools() is not None
    requests = [
        calls.submit(
            prompt, body.sampling(limit, i), top_logprobs=body.top_logprobs, version=version
        )
        for i in range(body.n)
    ]
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if body.stream:
        stream = _chat_stream(
            calls, body, prompt=prompt, requests=requests, rid=rid, created=created, tools=tools
        )
        return await calls.streaming(requests, stream)
    outputs = await calls.collect(requests, body.stops(), tools)
    response: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [
            _chat_choice(calls.codec, body, index, output) for index, output in enumerate(outputs)
        ],
        "usage": usage(len(prompt), outputs),
    }
    if body.return_token_ids:
        response["prompt_token_ids"] = prompt
    return OrjsonResponse(response, headers={VERSION_HEADER: str(requests[0].version)})


def _chat_choice(
    codec: TextCodec, body: ChatCompletionRequest, index: int, output: ChoiceOutput
) -> dict[str, Any]:
    content, calls, reason = output.message()
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    choice: dict[str, Any] = {
        "index": index,
        "message": message,
        "finish_reason": reason,
        "stop_reason": None,
        "logprobs": None,
    }
    if body.logprobs:
        choice["logprobs"] = {"content": [_chat_logprob(codec, t) for t in output.tokens]}
    if body.return_token_ids:
        choice["token_ids"] = output.ids
    return choice


async def _chat_stream(
    calls: EngineCalls,
    body: ChatCompletionRequest,
    *,
    prompt: list[int],
    requests: list[EngineRequest],
    rid: str,
    created: int,
    tools: bool,
) -> AsyncIterator[bytes]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": body.model}
    for index in range(len(requests)):
        first: dict[str, Any] = {**head, "choices": [_delta(index, role="assistant", content="")]}
        if body.return_token_ids:
            first["prompt_token_ids"] = prompt
        yield sse(first)
    outputs: list[ChoiceOutput] = []
    async for index, output, token, delta in calls.merged(requests, body.stops(), tools, outputs):
        choice = _delta(index, **({"content": delta} if delta else {}))
        if body.logprobs:
            choice["logprobs"] = {"content": [_chat_logprob(calls.codec, token)]}
        if body.return_token_ids:
            choice["token_ids"] = [token.token_id]
        chunks = [choice]
        if token.finish_reason is not None:
            chunks = _finished(chunks, index, output)
        for chunk in chunks:
            yield sse({**head, "choices": [chunk]})
    if body.stream_options and body.stream_options.include_usage:
        yield sse({**head, "choices": [], "usage": usage(len(prompt), outputs)})
    yield b"data: [DONE]\n\n"


def _delta(index: int, **delta: Any) -> dict[str, Any]:
    """A stream chunk's choice: `delta` as given, no log-probs, not finished."""
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}


def _finished(
    chunks: list[dict[str, Any]], index: int, output: ChoiceOutput
) -> list[dict[str, Any]]:
    """A choice's last chunks: the text a possible tool call held back, its tool calls, and
    the finish reason on the last of them."""
    rest, calls, reason = output.finish()
    if rest:
        chunks.append(_delta(index, content=rest))
    if calls:
        chunks.append(_delta(index, tool_calls=[c.to_openai(i) for i, c in enumerate(calls)]))
    chunks[-1] = {**chunks[-1], "finish_reason": reason, "stop_reason": None}
    return chunks


def _chat_logprob(codec: TextCodec, token: Token) -> dict[str, Any]:
    text = codec.token_text(token.token_id)
    return {
        "token": text,
        "logprob": token.logprob,
        "bytes": list(text.encode()),
        "top_logprobs": [
            {"token": (t := codec.token_text(i)), "logprob": lp, "bytes": list(t.encode())}
            for i, lp in token.top
        ],
    }
