"""`/v1/responses`: OpenAI's Responses API, served through the engine's chat completions.

`POST /v1/responses` is translated to a chat completion (responses_request.py), forwarded
and captured exactly like a chat call, and answered as a Response (responses_output.py) or
its event stream (responses_stream.py). With `store` (the default) the response is kept for
the episode (responses_store.py), so `previous_response_id` chains and
`GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
`DELETE /v1/responses/{id}` work as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harnessrl.episode_token import EpisodeClaims
from harnessrl.http import Response
from harnessrl.services.gateway.dialects.base import EngineCall
from harnessrl.services.gateway.dialects.responses_output import (
    Echo,
    chat_to_response,
    response_id,
)
from harnessrl.services.gateway.dialects.responses_request import responses_to_chat
from harnessrl.services.gateway.dialects.responses_store import Key, ResponseStore, Stored
from harnessrl.services.gateway.dialects.responses_stream import ResponseStream
from harnessrl.services.gateway.errors import OPENAI, ErrorShape, GatewayError, invalid, respond
from harnessrl.trust.contract import CHAT_PATH
from harnessrl.v1 import events_pb2 as pb


class ResponsesDialect:
    kind: str = "responses"
    api: int = pb.API_OPENAI_RESPONSES
    errors: ErrorShape = OPENAI

    def __init__(
        self,
        store: ResponseStore,
        *,
        drop_unserved: bool = True,
        on_dropped: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self.store = store
        self._drop = drop_unserved
        self._on_dropped = on_dropped

    def translate(self, body: dict[str, Any], claims: EpisodeClaims) -> EngineCall:
        key = (claims.episode_id, claims.attempt)
        previous = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        if previous is not None:
            if not isinstance(previous, str):
                raise invalid("previous_response_id", "must be a string")
            found = self.store.history(key, previous)
            if found is None:
                raise invalid(
                    "previous_response_id", f"no stored response {previous!r} in this episode"
                )
            history = found
        translation = responses_to_chat(body, history, drop_unserved=self._drop)
        for kind in translation.dropped:
            self._on_dropped(kind)
        model = translation.chat["model"]
        echo = Echo(body, model, translation.custom_tools, translation.namespaces)
        keep = body.get("store") is not False
        renderer = _Render(
            self.store,
            key=key,
            expires_at=claims.expires_at,
            echo=echo,
            items=translation.items,
            keep=keep,
        )
        return EngineCall(
            CHAT_PATH,
            translation.chat,
            translation.chat["stream"],
            translation.chat["model"],
            renderer,
            "max_output_tokens",
            "input",
        )

    def route(self, method: str, rest: str, claims: EpisodeClaims) -> Response:
        """`GET|DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`."""
        key = (claims.episode_id, claims.attempt)
        response_id, _, sub = rest.partition("/")
        stored = self.store.get(key, response_id)
        if stored is None:
            raise GatewayError(404, f"no stored response with id {response_id!r}", "response_id")
        if sub == "input_items" and method == "GET":
            items = [_with_id(item, response_id, i) for i, item in enumerate(stored.items)]
            listing = {
                "object": "list",
                "data": items[::-1],  # newest first, OpenAI's default order
                "first_id": items[-1]["id"] if items else None,
                "last_id": items[0]["id"] if items else None,
                "has_more": False,
            }
            return respond(200, listing)
        if sub:
            raise GatewayError(404, f"/v1/responses/{rest}: not found")
        if method == "GET":
            return respond(200, stored.response)
        if method == "DELETE":
            self.store.delete(key, response_id)
            return respond(200, {"id": response_id, "object": "response", "deleted": True})
        raise GatewayError(405, f"{method} /v1/responses/{{id}}: method not allowed")


class _Render:
    """Renders one call's answer, and stores it when the request asked to."""

    def __init__(
        self,
        store: ResponseStore,
        *,
        key: Key,
        expires_at: float,
        echo: Echo,
        items: list[dict[str, Any]],
        keep: bool,
    ) -> None:
        self._store, self._key, self._expires = store, key, expires_at
        self._echo, self._items, self._keep = echo, items, keep
        self._id = response_id()

    def body(self, data: dict[str, Any]) -> Any:
        response = chat_to_response(data, self._echo, self._id)
        self._done(response)
        return response

    def stream(self) -> ResponseStream:
        return ResponseStream(self._echo, self._done, self._id)

    def response_id(self, engine_id: str) -> str:
        return self._id

    def _done(self, response: dict[str, Any]) -> None:
        if self._keep:
            previous = self._echo.request.get("previous_response_id")
            self._store.put(self._key, Stored(response, self._items, previous, self._expires))


def _with_id(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    if "id" in item:
        return item
    return {"id": f"item_{response_id.removeprefix('resp_')}_{index}", **item}
