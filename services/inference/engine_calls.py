"""A request's calls into the engine, as the generating routes (engine_chat.py,
engine_completions.py) make them: the model and context-length checks (a model name
`<served name>@v<N>` asks for policy version N), the choices' tokens
collected or merged as they arrive, every choice aborted when the client goes away, the
streaming response (its header carries the policy version that serves it), and the SSE
event and usage shapes both routes write.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import JSONResponse, Response, StreamingResponse

from harnessrl.services.inference.codec import TextCodec
from harnessrl.services.inference.engine import Engine, EngineRequest, Token, VersionNotServed
from harnessrl.services.inference.generation import ChoiceOutput
from harnessrl.services.inference.protocol import ApiError
from harnessrl.services.inference.sampling import SamplingParams

VERSION_HEADER = "x-policy-version"
_VERSIONED = re.compile(r"^(?P<name>.+)@v(?P<version>\d+)$")


class OrjsonResponse(JSONResponse):
    """A JSON response serialised by orjson."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class EngineCalls:
    """One engine behind the API: its served names, its codec, its default completion budget."""

    def __init__(
        self, engine: Engine, codec: TextCodec, names: list[str], default_max: int
    ) -> None:
        self.engine = engine
        self.codec = codec
        self.names = set(names)
        self.name = names[0]
        self.default_max = default_max

    def version_name(self, version: int) -> str:
        """The model name that asks for policy `version`."""
        return f"{self.name}@v{version}"

    def check_model(self, model: str | None) -> int | None:
        """The policy version `model` asks for: N for `<served name>@v<N>`, None for a
        served name (the newest version served) or None (the default, as vLLM's
        `/tokenize` takes it). Raises ApiError(404) for any other name, or a version not
        served here."""
        if model is None or model in self.names:
            return None
        versioned = _VERSIONED.match(model)
        if versioned is None or versioned["name"] not in self.names:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        version = int(versioned["version"])
        if version not in self.engine.versions:
            raise _not_served(version)
        return version

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        *,
        top_logprobs: int,
        version: int | None,
    ) -> EngineRequest:
        """The engine's submit, a version no longer served answered 404."""
        try:
            return self.engine.submit(prompt, params, top_logprobs=top_logprobs, version=version)
        except VersionNotServed as err:
            raise _not_served(err.version) from err

    def token_limit(self, prompt_len: int, asked: int | None, param: str) -> int:
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

    async def collect(
        self, requests: list[EngineRequest], stops: tuple[str, ...], tools: bool
    ) -> list[ChoiceOutput]:
        """Every choice's whole output, once all are done; raises ApiError(500) when the
        engine failed one. Cancelled (the client went away): every choice is aborted."""
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
        raise_engine_failure(requests)
        return outputs

    async def merged(
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
                    raise_engine_failure(requests[index : index + 1])
                    open_choices -= 1
                    continue
                delta = outputs[index].step(token)
                yield index, outputs[index], token, delta
        finally:
            for request in requests:
                self.engine.abort(request)
            for task in pumps:
                task.cancel()

    async def streaming(
        self, requests: list[EngineRequest], stream: AsyncIterator[bytes]
    ) -> Response:
        """`stream` as an SSE response, once the first choice is admitted (so the header
        carries the version that serves it); an engine failure mid-way ends the stream in
        an error event."""
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


def _not_served(version: int) -> ApiError:
    return ApiError(404, f"model: version {version} is not served here", "model", "model_not_found")


def raise_engine_failure(requests: list[EngineRequest]) -> None:
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
        yield sse(err.body())
        yield b"data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event carrying `data` as JSON."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def usage(prompt_tokens: int, outputs: list[ChoiceOutput]) -> dict[str, int]:
    """OpenAI's usage object: prompt, completion (every choice's) and total tokens."""
    completion = sum(len(o.ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
