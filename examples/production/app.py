"""A calculator help desk: the production service a team runs, knowing nothing of training.

An HTTP app (FastAPI) in front of the calculator agent of examples/calculator (its prompt,
its tool, its loop: `solve`), on the `openai` SDK with one fixed base URL and the app's key:

    POST /ask     {"user", "question"} -> {"conversation", "answer", "kind", "response_ids"}
    POST /thumbs  {"conversation", "up"} -> the feedback service's answer
    POST /resolved {"conversation", "resolved"} -> the feedback service's answer (the
                  desk's ticket system reports whether the user's problem was solved)

Each question is a conversation of its own, named by the app (`<user>.<n>`); every model
call of it carries the conversation as its session (`x-harnessrl-session`) and the desk's
routing label as its kind (`x-harnessrl-kind`: sum, difference, product, quotient or other,
from keywords, as a support desk routes tickets). When the agent has answered, the app ends
the session (`POST <base URL without /v1>/sessions/<id>/end`). The thumbs button relays to
the feedback API, configured like any other backend the team calls: a URL and a key.

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=<app key> \\
    FEEDBACK_URL=http://127.0.0.1:8240 python -m examples.production.app --port 8300

The feedback key defaults to OPENAI_API_KEY (FEEDBACK_API_KEY overrides it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import openai
from examples.calculator.harness import solve
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

if TYPE_CHECKING:  # the HTTP client the openai SDK is built on
    from httpx2 import Response as SdkResponse

SESSION_HEADER = "x-harnessrl-session"
KIND_HEADER = "x-harnessrl-kind"
_ROUTES = (  # the desk's routing table: first match wins
    ("quotient", re.compile(r"divid|/|quotient", re.I)),
    ("product", re.compile(r"times|multipl|\*|product", re.I)),
    ("difference", re.compile(r"minus|subtract|-|difference", re.I)),
    ("sum", re.compile(r"plus|add|\+|sum", re.I)),
)
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
FEEDBACK_RETRY_S = 15.0
"""How long a thumbs relay retries a 404: the feedback service learns of a conversation
from the pipeline, a moment after the app ended it."""


def route(question: str) -> str:
    """The desk's label for a question: the first keyword rule that matches, else other."""
    return next((kind for kind, rule in _ROUTES if rule.search(question)), "other")


@dataclass(frozen=True, slots=True)
class Settings:
    base_url: str
    """The model API's base URL (OPENAI_BASE_URL): `<gateway>/v1`."""
    api_key: str
    """The app's key (OPENAI_API_KEY)."""
    feedback_url: str
    """Base URL of the feedback API (FEEDBACK_URL)."""
    feedback_key: str
    """Key of the feedback API (FEEDBACK_API_KEY, default: the app's key)."""

    @classmethod
    def from_env(cls) -> Settings:
        """From the environment; KeyError names a variable that is missing."""
        key = os.environ["OPENAI_API_KEY"]
        return cls(
            base_url=os.environ["OPENAI_BASE_URL"].rstrip("/"),
            api_key=key,
            feedback_url=os.environ["FEEDBACK_URL"].rstrip("/"),
            feedback_key=os.environ.get("FEEDBACK_API_KEY", key),
        )


class Ask(BaseModel):
    user: Annotated[str, Field(pattern=_USER.pattern)]
    question: Annotated[str, Field(min_length=1, max_length=2000)]


class Thumbs(BaseModel):
    conversation: Annotated[str, Field(min_length=1, max_length=128)]
    up: bool


class Resolved(BaseModel):
    conversation: Annotated[str, Field(min_length=1, max_length=128)]
    resolved: bool


class ResponseIds:
    """The ids of the model's answers, by conversation: read off each response as the SDK
    receives it (an httpx response hook), since the agent loop returns only the answer."""

    def __init__(self) -> None:
        self._ids: dict[str, list[str]] = {}
        self._lock = threading.Lock()

    def hook(self, response: SdkResponse) -> None:
        conversation = response.request.headers.get(SESSION_HEADER)
        if conversation is None or response.status_code != 200:
            return
        response.read()
        response_id = json.loads(response.content).get("id")
        if isinstance(response_id, str):
            with self._lock:
                self._ids.setdefault(conversation, []).append(response_id)

    def pop(self, conversation: str) -> list[str]:
        with self._lock:
            return self._ids.pop(conversation, [])


class Desk:
    """The desk's backends: the model (one OpenAI client), the gateway's session end and
    the feedback API (one httpx client). Thread-safe: FastAPI runs the routes in threads."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ids = ResponseIds()
        self._http = httpx.Client(timeout=60.0)
        self.model = openai.OpenAI(
            base_url=settings.base_url,
            api_key=settings.api_key,
            max_retries=8,
            http_client=openai.DefaultHttpxClient(event_hooks={"response": [self.ids.hook]}),
        )
        self._numbers = itertools.count()
        self._started = int(time.time())

    def conversation(self, user: str) -> str:
        return f"{user}.{self._started}-{next(self._numbers)}"

    def end(self, conversation: str) -> None:
        """End the conversation's session at the gateway (its root: the base URL's parent)."""
        root = self.settings.base_url.removesuffix("/v1")
        response = self._http.post(
            f"{root}/sessions/{conversation}/end",
            headers={"authorization": f"Bearer {self.settings.api_key}"},
        )
        if response.status_code != 404:  # 404: no call of it reached the model
            response.raise_for_status()

    def thumbs(self, conversation: str, up: bool) -> httpx.Response:
        """Relay a thumbs to the feedback API; a 404 (not there yet) is retried a while."""
        return self.signal(conversation, "thumbs", 1.0 if up else -1.0)

    def signal(self, conversation: str, name: str, value: float) -> httpx.Response:
        """Send one feedback signal; a 404 (not there yet) is retried a while."""
        body = {"session": conversation, "name": name, "value": value}
        headers = {"authorization": f"Bearer {self.settings.feedback_key}"}
        deadline = time.monotonic() + FEEDBACK_RETRY_S
        while True:
            response = self._http.post(
                f"{self.settings.feedback_url}/v1/feedback", json=body, headers=headers
            )
            if response.status_code != 404 or time.monotonic() > deadline:
                return response
            time.sleep(0.5)

    def close(self) -> None:
        self.model.close()
        self._http.close()


def current_desk(request: Request) -> Desk:
    """The desk of the app's lifespan state (opened at startup, closed at shutdown)."""
    desk: Desk = request.state.desk
    return desk


CurrentDesk = Annotated[Desk, Depends(current_desk)]


def create_app(settings: Settings) -> FastAPI:
    """The help desk app over `settings`' backends."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[dict[str, Desk]]:
        desk = Desk(settings)
        try:
            yield {"desk": desk}
        finally:
            desk.close()

    app = FastAPI(title="calculator help desk", lifespan=lifespan)

    @app.post("/ask")
    def ask(body: Ask, desk: CurrentDesk) -> dict[str, Any]:
        conversation = desk.conversation(body.user)
        kind = route(body.question)
        client = desk.model.with_options(
            default_headers={SESSION_HEADER: conversation, KIND_HEADER: kind}
        )
        try:
            result = solve(client, body.question)
        finally:
            response_ids = desk.ids.pop(conversation)
            desk.end(conversation)
        return {
            "conversation": conversation,
            "answer": result["answer"],
            "kind": kind,
            "response_ids": response_ids,
        }

    @app.post("/thumbs")
    def thumbs(body: Thumbs, desk: CurrentDesk) -> JSONResponse:
        response = desk.thumbs(body.conversation, body.up)
        return JSONResponse(response.json(), status_code=response.status_code)

    @app.post("/resolved")
    def resolved(body: Resolved, desk: CurrentDesk) -> JSONResponse:
        response = desk.signal(body.conversation, "resolved", 1.0 if body.resolved else 0.0)
        return JSONResponse(response.json(), status_code=response.status_code)

    @app.exception_handler(openai.APIError)
    async def model_failed(request: Request, err: openai.APIError) -> JSONResponse:
        return JSONResponse({"detail": f"the model failed: {err}"}, status_code=502)

    return app


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    args = parser.parse_args(argv)
    app = create_app(Settings.from_env())
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
