"""The engine's HTTP API: OpenAI's routes in vLLM's dialect.

`/v1/chat/completions` and `/v1/completions`, streamed (SSE) or not, plus `/v1/models`,
vLLM's `/tokenize` (services/inference/tokenization.py), `/healthz` and `/metrics`. With
`return_token_ids: true` responses carry vLLM's extra fields: `prompt_token_ids` (chat: top
level and in the first stream chunk; completions: per choice) and per-choice `token_ids` (in
every stream chunk, even when a tool call holds the text back). Log-probs are those of the
distribution each token was sampled from, after temperature and top-p (vLLM's processed
log-probs); the trainer relies on this. Every response carries the policy version that
served it in the `x-policy-version` header.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from harnessrl.health import health_body
from harnessrl.services.inference.codec import TextCodec
from harnessrl.services.inference.engine import Engine, EngineRequest, Token
from harnessrl.services.inference.errors import (
    api_error_response,
    http_error_response,
    openapi_document,
)
from harnessrl.services.inference.generation import ChoiceOutput
from harnessrl.services.inference.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    TokenizeRequest,
)
from harnessrl.services.inference.tokenization import RESPONSES as TOKENIZE_RESPONSES
from harnessrl.services.inference.tokenization import tokenize

VERSION_HEADER = "x-policy-version"
# What the OpenAPI document says the generating routes answer: JSON, or an SSE stream when
# the request asks for one; every error in OpenAI's shape.
_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}},
    400: {"model": ErrorResponse, "description": "Invalid request (the field is named)"},
    404: {"model": ErrorResponse, "description": "No such model"},
}


class _Json(JSONResponse):
    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def create_app(
    engine: Engine,
    codec: TextCodec,
    *,
    served_names: list[str],
    default_max_tokens: int,
    registry: CollectorRegistry,
    health: Callable[[], dict[str, bool]],
) -> FastAPI:
    """The API app for one engine. `served_names[0]` is the name models are listed under."""
    app = FastAPI(title="harnessrl inference engine", docs_url=None, redoc_url=None)
    api = _Api(engine, codec, served_names, default_max_tokens)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> Response:
        return _Json(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> Response:
        return api_error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        return http_error_response(request, err)

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "harnessrl",
                "max_model_len": engine.max_model_len,
            }
            for name in served_names[:1]
        ]
        return _Json({"object": "list", "data": data})

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat(body: ChatCompletionRequest) -> Response:
        return await api.chat(body)

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest) -> Response:
        return await api.completions(body)

    @app.post("/tokenize", responses=TOKENIZE_RESPONSES)
    async def tokenize_prompt(body: TokenizeRequest) -> Response:
        api.check_model(body.model)
        return _Json(tokenize(codec, body, max_model_len=engine.max_model_len))

    @app.get("/healthz", responses={503: {"description": "A component is not healthy"}})
    async def healthz() -> Response:
        status, body = health_body(health())
        return Response(body, status_code=status, media_type="application/json")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]  # FastAPI's hook
    return app


class _Api:
    def __init__(
        self, engine: Engine, codec: TextCodec, names: list[str], default_max: int
    ) -> None:
        self.engine = engine
        self.codec = codec
        self.names = set(names)
        self.name = names[0]
        self.default_max = default_max

    # -- chat --------------------------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest) -> Response:
        self.check_model(body.model)
        prompt = self.codec.chat_prompt(body.template_messages(), body.template_tools())
        limit = self._token_limit(len(prompt), body.token_limit, "messages")
        tools = body.template_tools() is not None
        requests = [
            self.engine.submit(prompt, body.sampling(limit, i), top_logprobs=body.top_logprobs)
            for i in range(body.n)
        ]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            stream = self._chat_stream(
                body, prompt=prompt, requests=requests, rid=rid, created=created, tools=tools
            )
            return await self._streaming(requests, stream)
        outputs = await self._collect(requests, body.stops(), tools)
        choices = []
        for index, output in enumerate(outputs):
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
                choice["logprobs"] = {"content": [self._chat_logprob(t) for t in output.tokens]}
            if body.return_token_ids:
                choice["token_ids"] = output.ids
            choices.append(choice)
        response: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": body.model,
            "choices": choices,
            "usage": _usage(len(prompt), outputs),
        }
        if body.return_token_ids:
            response["prompt_token_ids"] = prompt
        return _Json(response, headers={VERSION_HEADER: str(requests[0].version)})

    async def _chat_stream(
        self,
        body: ChatCompletionRequest,
        *,
        prompt: list[int],
        requests: list[EngineRequest],
        rid: str,
        created: int,
        tools: bool,
    ) -> AsyncIterator[bytes]:
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
        }
        for index in range(len(requests)):
            first: dict[str, Any] = {
                **head,
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            }
            if body.return_token_ids:
                first["prompt_token_ids"] = prompt
            yield _sse(first)
        outputs: list[ChoiceOutput] = []
        async for index, output, token, delta in self._merged(
            requests, body.stops(), tools, outputs
        ):
            choice: dict[str, Any] = {
                "index": index,
                "delta": {"content": delta} if delta else {},
                "logprobs": None,
                "finish_reason": None,
            }
            if body.logprobs:
                choice["logprobs"] = {"content": [self._chat_logprob(token)]}
            if body.return_token_ids:
                choice["token_ids"] = [token.token_id]
            chunks = [choice]
            if token.finish_reason is not None:
                rest, calls, reason = output.finish()
                if rest:
                    chunks.append(
                        {
                            "index": index,
                            "delta": {"content": rest},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                if calls:
                    chunks.append(
                        {
                            "index": index,
                            "delta": {"tool_calls": [c.to_openai(i) for i, c in enumerate(calls)]},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                chunks[-1] = {**chunks[-1], "finish_reason": reason, "stop_reason": None}
            for chunk in chunks:
                yield _sse({**head, "choices": [chunk]})
        if body.stream_options and body.stream_options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(len(prompt), outputs)})
        yield b"data: [DONE]\n\n"

    def _chat_logprob(self, token: Token) -> dict[str, Any]:
        text = self.codec.token_text(token.token_id)
        return {
            "token": text,
            "logprob": token.logprob,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (t := self.codec.token_text(i)), "logprob": lp, "bytes": list(t.encode())}
                for i, lp in token.top
            ],
        }

    # -- completions -------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest) -> Response:
        self.check_model(body.model)
        prompts = [p if isinstance(p, list) else self.codec.encode(p) for p in body.prompts()]
        for ids in prompts:
            if any(not 0 <= i < self.codec.vocab_size for i in ids):
                raise ApiError(
                    400, f"prompt: token ids must be in [0, {self.codec.vocab_size})", "prompt"
                )
        limits = [self._token_limit(len(ids), body.token_limit, "prompt") for ids in prompts]
        top = body.logprobs or 0
        requests = [
            self.engine.submit(ids, body.sampling(limit, c), top_logprobs=top)
            for ids, limit in zip(prompts, limits, strict=True)
            for c in range(body.n)
        ]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choice_prompts = [ids for ids in prompts for _ in range(body.n)]
        if body.stream:
            stream = self._completion_stream(
                body, prompts=choice_prompts, requests=requests, rid=rid, created=created
            )
            return await self._streaming(requests, stream)
        outputs = await self._collect(requests, body.stops(), tools=False)
        choices = []
        for index, (output, ids) in enumerate(zip(outputs, choice_prompts, strict=True)):
            text, _, reason = output.message()
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "finish_reason": reason,
                "stop_reason": None,
                "logprobs": None,
            }
            if body.logprobs is not None:
                choice["logprobs"] = self._completion_logprobs(output.tokens)
            if body.return_token_ids:
                choice["prompt_token_ids"] = ids
                choice["token_ids"] = output.ids
            choices.append(choice)
        usage = _usage(sum(len(p) for p in prompts), outputs)
        response = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "choices": choices,
            "usage": usage,
        }
        return _Json(response, headers={VERSION_HEADER: str(requests[0].version)})

    async def _completion_stream(
        self,
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
        async for index, output, token, delta in self._merged(
            requests, body.stops(), False, outputs
        ):
            text, reason = delta, None
            if token.finish_reason is not None:
                rest, _, reason = output.finish()
                text += rest
            choice: dict[str, Any] = {
                "index": index,
                "text": text,
                "finish_reason": reason,
                "stop_reason": None,
                "logprobs": None,
            }
            if body.logprobs is not None:
                choice["logprobs"] = self._completion_logprobs([token])
            if body.return_token_ids:
                choice["token_ids"] = [token.token_id]
                if index not in started:
                    choice["prompt_token_ids"] = prompts[index]
            started.add(index)
            yield _sse({**head, "choices": [choice]})
        if body.stream_options and body.stream_options.include_usage:
            usage = _usage(sum(len(p) for p in prompts[:: body.n]), outputs)
            yield _sse({**head, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    def _completion_logprobs(self, tokens: list[Token]) -> dict[str, Any]:
        texts = [self.codec.token_text(t.token_id) for t in tokens]
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{self.codec.token_text(i): lp for i, lp in t.top} for t in tokens],
            "text_offset": offsets,
        }

    # -- shared ------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """Raises ApiError(404) unless `model` is a served name (None: the default, as
        vLLM's `/tokenize` takes it)."""
        if model is not None and model not in self.names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def _token_limit(self, prompt_len: int, asked: int | None, param: str) -> int:
        if prompt_len == 0:  # nothing to condition on: the engine's prefill needs a token
            raise ApiError(400, f"{param}: must not be empty (it encodes to no tokens)", param)
        context = self.engine.max_model_len
        if prompt_len >= context or (asked is not None and prompt_len + asked > context):
            raise ApiError(
                400,
                f"This model's maximum context length is {context} tokens. However, you "
                f"requested {prompt_len + (asked or 1)} tokens ({prompt_len} in the {param}, "
                f"{asked or 1} in the completion). Please reduce the length of the {param} or "
                "completion.",
                param,
                "context_length_exceeded",
            )
        return asked if asked is not None else min(self.default_max, context - prompt_len)

    async def _collect(
        self, requests: list[EngineRequest], stops: tuple[str, ...], tools: bool
    ) -> list[ChoiceOutput]:
        outputs = [ChoiceOutput(self.codec.decode, stops, tools) for _ in requests]

        async def drain(request: EngineRequest, output: ChoiceOutput) -> None:
            while (token := await request.tokens.get()) is not None:
                output.add(token)

        try:
            await asyncio.gather(*(drain(r, o) for r, o in zip(requests, outputs, strict=True)))
        except asyncio.CancelledError:  # the client went away: stop generating for it
            for request in requests:
                self.engine.abort(request)
            raise
        _raise_engine_failure(requests)
        return outputs

    async def _merged(
        self,
        requests: list[EngineRequest],
        stops: tuple[str, ...],
        tools: bool,
        outputs: list[ChoiceOutput],
    ) -> AsyncIterator[tuple[int, ChoiceOutput, Token, str]]:
        """(choice index, its output, new token, content delta) as tokens arrive, across
        choices. Fills `outputs` (for usage)."""
        outputs.extend(ChoiceOutput(self.codec.decode, stops, tools) for _ in requests)
        queue: asyncio.Queue[tuple[int, Token | None]] = asyncio.Queue()

        async def pump(index: int, request: EngineRequest) -> None:
            while (token := await request.tokens.get()) is not None:
                queue.put_nowait((index, token))
            queue.put_nowait((index, None))

        pumps = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
        try:
            open_choices = len(requests)
            while open_choices:
                index, token = await queue.get()
                if token is None:
                    _raise_engine_failure(requests[index : index + 1])
                    open_choices -= 1
                    continue
                delta = outputs[index].step(token)
                yield index, outputs[index], token, delta
        finally:
            for request in requests:
                self.engine.abort(request)
            for task in pumps:
                task.cancel()

    async def _streaming(
        self, requests: list[EngineRequest], stream: AsyncIterator[bytes]
    ) -> Response:
        # Wait for admission so the header can carry the version that serves the request.
        try:
            await requests[0].admitted.wait()
        except asyncio.CancelledError:
            for request in requests:
                self.engine.abort(request)
            raise
        return StreamingResponse(
            _ending_in_error_events(stream),
            media_type="text/event-stream",
            headers={VERSION_HEADER: str(requests[0].version), "cache-control": "no-cache"},
        )


def _raise_engine_failure(requests: list[EngineRequest]) -> None:
    """An ApiError (500) when the engine failed one of these requests (its step raised)."""
    for request in requests:
        if request.error is not None:
            raise ApiError(500, request.error, None, "engine_error")


async def _ending_in_error_events(stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A stream whose engine failed mid-way ends as vLLM's do: an event carrying the error
    in OpenAI's shape, then `[DONE]` (the status line went out with the first chunk)."""
    try:
        async for chunk in stream:
            yield chunk
    except ApiError as err:
        yield _sse(err.body())
        yield b"data: [DONE]\n\n"


def _sse(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _usage(prompt_tokens: int, outputs: list[ChoiceOutput]) -> dict[str, int]:
    completion = sum(len(o.ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
