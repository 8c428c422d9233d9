"""`/v1/completions` in vLLM's dialect: prompts as text or token ids (each checked against
the vocabulary), `n` choices per prompt, an answer whole or streamed (SSE), log-probs in the
legacy completions shape.

With `return_token_ids: true` every choice carries its `prompt_token_ids` (in its first
stream chunk) and its `token_ids`.
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
from harnessrl.services.inference.protocol import ApiError, CompletionRequest


async def completions(calls: EngineCalls, body: CompletionRequest) -> Response:
    """The completion `body` asks for (raises ApiError for a model not served, a token id
    outside the vocabulary or a prompt beyond the context)."""
    version = calls.check_model(body.model)
    prompts = _prompt_ids(calls.codec, body)
    limits = [calls.token_limit(len(ids), body.token_limit, "prompt") for ids in prompts]
    top = body.logprobs or 0
    requests = [
        calls.submit(ids, body.sampling(limit, c), top_logprobs=top, version=version)
        for ids, limit in zip(prompts, limits, strict=True)
        for c in range(body.n)
    ]
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    choice_prompts = [ids for ids in prompts for _ in range(body.n)]
    if body.stream:
        stream = _completion_stream(
            calls, body, prompts=choice_prompts, requests=requests, rid=rid, created=created
        )
        return await calls.streaming(requests, stream)
    outputs = await calls.collect(requests, body.stops(), tools=False)
    choices = [
        _completion_choice(calls.codec, body, index, output, ids)
        for index, (output, ids) in enumerate(zip(outputs, choice_prompts, strict=True))
    ]
    response = {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": choices,
        "usage": usage(sum(len(p) for p in prompts), outputs),
    }
    return OrjsonResponse(response, headers={VERSION_HEADER: str(requests[0].version)})


def _prompt_ids(codec: TextCodec, body: CompletionRequest) -> list[list[int]]:
    """Each prompt as token ids; raises ApiError(400) naming `prompt` for an id outside
    the vocabulary."""
    prompts = [p if isinstance(p, list) else codec.encode(p) for p in body.prompts()]
    for ids in prompts:
        if any(not 0 <= i < codec.vocab_size for i in ids):
            raise ApiError(400, f"prompt: token ids must be in [0, {codec.vocab_size})", "prompt")
    return prompts


def _completion_choice(
    codec: TextCodec, body: CompletionRequest, index: int, output: ChoiceOutput, ids: list[int]
) -> dict[str, Any]:
    text, _, reason = output.message()
    tokens = output.tokens if body.logprobs is not None else None
    choice = _choice(codec, index, text, reason, tokens)
    if body.return_token_ids:
        choice["prompt_token_ids"] = ids
        choice["token_ids"] = output.ids
    return choice


async def _completion_stream(
    calls: EngineCalls,
    body: CompletionRequest,
    *,
    prompts: list[list[int]],
    requests: list[EngineRequest],
    rid: str,
    created: int,
) -> AsyncIterator[bytes]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}
    started: set[int] = set()
    outputs: list[ChoiceOutput] = []
    async for index, output, token, delta in calls.merged(requests, body.stops(), False, outputs):
        text, reason = delta, None
        if token.finish_reason is not None:
            rest, _, reason = output.finish()
            text += rest
        tokens = [token] if body.logprobs is not None else None
        choice = _choice(calls.codec, index, text, reason, tokens)
        if body.return_token_ids:
            choice["token_ids"] = [token.token_id]
            if index not in started:
                choice["prompt_token_ids"] = prompts[index]
        started.add(index)
        yield sse({**head, "choices": [choice]})
    if body.stream_options and body.stream_options.include_usage:
        total = usage(sum(len(p) for p in prompts[:: body.n]), outputs)
        yield sse({**head, "choices": [], "usage": total})
    yield b"data: [DONE]\n\n"


def _choice(
    codec: TextCodec, index: int, text: str | None, reason: str | None, tokens: list[Token] | None
) -> dict[str, Any]:
    """A completions choice (or a stream chunk's); `tokens`: those its log-probs cover, None
    when none were asked for."""
    return {
        "index": index,
        "text": text,
        "finish_reason": reason,
        "stop_reason": None,
        "logprobs": None if tokens is None else _completion_logprobs(codec, tokens),
    }


def _completion_logprobs(codec: TextCodec, tokens: list[Token]) -> dict[str, Any]:
    texts = [codec.token_text(t.token_id) for t in tokens]
    offsets, position = [], 0
    for text in texts:
        offsets.append(position)
        position += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{codec.token_text(i): lp for i, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }
