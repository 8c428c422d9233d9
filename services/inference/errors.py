"""Invalid requests answered in OpenAI's error shape, and an OpenAPI document that says so.

FastAPI answers a body that fails validation with a 422 of its own shape; the engine answers
400 with OpenAI's error object instead, its `param` the path of the invalid field in the
body (`messages.0.content`), as OpenAI and vLLM do.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from harnessrl.services.inference.protocol import ApiError


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document of `app` without its 422 answers: validation errors are 400s in
    OpenAI's shape here (`api_error_response`), which the routes declare. Built once."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def api_error_response(err: RequestValidationError) -> Response:
    """A 400 in OpenAI's shape naming the first invalid field by its path in the body
    (`messages.0.content`), or `body` for the body itself (not JSON, not an object)."""
    first = err.errors()[0]
    kind = first.get("type")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    loc = tuple(first.get("loc", ()))
    param = _body_path(loc[1:] if loc[:1] == ("body",) else loc, err.body, kind == "missing")
    if kind == "json_invalid":
        param, message = None, f"body: not valid JSON ({message})"
    elif param is None and (named := _NAMED.match(message)):
        param = named.group(1)  # a model validator's "field: reason"
    elif param is None:
        message = f"body: {message}"
    text = f"{param}: {message}" if param and not message.startswith(f"{param}:") else message
    return JSONResponse(ApiError(400, text, param).body(), status_code=400)


def http_error_response(request: Request, err: HTTPException) -> Response:
    """Starlette's own errors (no such route, method not allowed, an unparsable body) in
    OpenAI's shape too."""
    where = "body" if err.status_code == 400 else f"{request.method} {request.url.path}"
    body = ApiError(err.status_code, f"{where}: {err.detail}").body()
    return JSONResponse(body, status_code=err.status_code, headers=err.headers)


_NAMED = re.compile(r"^([A-Za-z_][\w.]*): ")


def _body_path(loc: tuple[Any, ...], body: Any, missing: bool) -> str | None:
    """The parts of a pydantic location that exist in the body: pydantic also names the
    union member it tried (`stop.str`), which is no field. A missing field is not in the
    body, so the last part is kept for those."""
    node, path = body, []
    for i, part in enumerate(loc):
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_dict or in_list:
            node = node[part]
        elif not (missing and i == len(loc) - 1):
            continue
        path.append(str(part))
    return ".".join(path) or None
