"""`GET /v1/models` and `GET /v1/models/{id}`, in the shape of the API the client speaks.

The gateway answers any model name under the name it was asked for (the engines serve one
policy), so the listing names the engine's model and a lookup finds whatever it is asked.
Anthropic's clients get Anthropic's shapes (`type: model`, `display_name`, `created_at`,
`has_more`), everyone else OpenAI's.
"""

from __future__ import annotations

from typing import Any

from harnessrl.http import Response
from harnessrl.services.gateway.dialects.openai_passthrough import MODEL_CHARS
from harnessrl.services.gateway.errors import GatewayError, respond

_EPOCH = "1970-01-01T00:00:00Z"


class Models:
    """The model answers of one gateway; `listing` is the engines' /v1/models answer."""

    def __init__(self, model: str, listing: dict[str, Any] | None = None) -> None:
        self._model = model
        self._listing = listing or {"object": "list", "data": [_openai(model)]}

    def answer(self, name: str | None, *, anthropic: bool) -> Response:
        if name is not None and (not name or len(name) > MODEL_CHARS):
            raise GatewayError(404, "model: no such model", "model")
        if anthropic:
            if name is not None:
                return respond(200, _anthropic(name))
            return respond(
                200,
                {
                    "data": [_anthropic(self._model)],
                    "has_more": False,
                    "first_id": self._model,
                    "last_id": self._model,
                },
            )
        if name is not None:
            return respond(200, _openai(name))
        return respond(200, self._listing)


def _openai(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "harnessrl"}


def _anthropic(name: str) -> dict[str, Any]:
    return {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": _EPOCH,
        "lifecycle": "active",
    }
