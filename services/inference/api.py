"""The engine's HTTP API: OpenAI's routes in vLLM's dialect, the app and its routes.

`/v1/chat/completions` (engine_chat.py) and `/v1/completions` (engine_completions.py),
streamed (SSE) or not, plus `/v1/models`, vLLM's `/tokenize` (tokenization.py), `/healthz`
and `/metrics`; errors in OpenAI's shape (errors.py). With `return_token_ids: true`
responses carry vLLM's extra fields: `prompt_token_ids` and per-choice `token_ids`.
Log-probs are those of the distribution each token was sampled from, after temperature and
top-p (vLLM's processed log-probs); the trainer relies on this. Every response carries the
policy version that served it in the `x-policy-version` header (engine_calls.py). Each
version the engine serves is asked for as `<served name>@v<version>` (and listed so during a
canary rollout); the served name itself asks for the newest version served.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException

from harnessrl.health import health_body
from harnessrl.services.inference import engine_chat, engine_completions
from harnessrl.services.inference.codec import TextCodec
from harnessrl.services.inference.engine import Engine
from harnessrl.services.inference.engine_calls import EngineCalls, OrjsonResponse
from harnessrl.services.inference.errors import (
    api_error_response,
    http_error_response,
    openapi_document,
)
from harnessrl.services.inference.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    TokenizeRequest,
)
from harnessrl.services.inference.tokenization import RESPONSES as TOKENIZE_RESPONSES
from harnessrl.services.inference.tokenization import tokenize

# What the OpenAPI document says the generating routes answer: JSON, or an SSE stream when
# the request asks for one; every error in OpenAI's shape.
_GENERATE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}},
    400: {"model": ErrorResponse, "description": "Invalid request (the field is named)"},
    404: {"model": ErrorResponse, "description": "No such model"},
}


def create_app(
    engine: Engine,
    codec: TextCodec,
    *,
    served_names: list[str],
    default_max_tokens: int,
    registry: CollectorRegistry,
    health: Callable[[], dict[str, bool]],
    list_versions: bool = False,
) -> FastAPI:
    """The API app for one engine. `served_names[0]` is the name models are listed under;
    `list_versions` (a canary rollout): each version served is listed too."""
    app = FastAPI(title="harnessrl inference engine", docs_url=None, redoc_url=None)
    calls = EngineCalls(engine, codec, served_names, default_max_tokens)
    _answer_errors(app)

    @app.get("/v1/models")
    async def models() -> Response:
        versions = map(calls.version_name, engine.versions) if list_versions else ()
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "harnessrl",
                "max_model_len": engine.max_model_len,
            }
            for name in [served_names[0], *versions]
        ]
        return OrjsonResponse({"object": "list", "data": data})

    @app.post("/v1/chat/completions", responses=_GENERATE_RESPONSES)
    async def chat(body: ChatCompletionRequest) -> Response:
        return await engine_chat.chat(calls, body)

    @app.post("/v1/completions", responses=_GENERATE_RESPONSES)
    async def completions(body: CompletionRequest) -> Response:
        return await engine_completions.completions(calls, body)

    @app.post("/tokenize", responses=TOKENIZE_RESPONSES)
    async def tokenize_prompt(body: TokenizeRequest) -> Response:
        calls.check_model(body.model)
        return OrjsonResponse(tokenize(codec, body, max_model_len=engine.max_model_len))

    @app.get("/healthz", responses={503: {"description": "A component is not healthy"}})
    async def healthz() -> Response:
        status, body = health_body(health())
        return Response(body, status_code=status, media_type="application/json")

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]  # FastAPI's hook
    return app


def _answer_errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape: the API's own, invalid bodies, HTTP errors."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, err: ApiError) -> Response:
        return OrjsonResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> Response:
        return api_error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        return http_error_response(request, err)
