"""Production sessions in the chaos mix: an app's traffic and its users' later feedback.

Beside the controller's episodes, an app (production.apps: `chaos`) opens sessions at the
gateway with its key, makes one to three calls in each, ends it, and after a random delay
sends a thumbs signal for most of them (some twice, as a client that retries does; some
never). Every request is retried while a killed service is away; what was accepted is
recorded here, and reconcile.py checks it against the topics: every call answered was
captured, every signal accepted was joined into its session's reward exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai

from harnessrl.logs import get_logger

log = get_logger(__name__)

APP = "chaos"
APP_KEY = "hrl-chaos-app-key-0123456789abcdefghij"
WINDOW_S = 20.0
"""The feedback window: a session without a signal is decided this long after its end."""
RETRY_FOR_S = 120.0
"""How long one request is retried while the services it needs are killed or frozen."""
SDK_RETRIES = 10
"""The SDKs' own retries (backing off up to 8 s): they outlast a gateway's restart."""
_QUESTIONS = ("What is 17 + 25?", "Subtract 9 from 40.", "Multiply 6 by 7.", "Divide 84 by 2.")


def session_env(workdir: Path) -> dict[str, str]:
    """The settings that add the `chaos` app to every service of the stack."""
    app = {
        "name": APP,
        "key_sha256": hashlib.sha256(APP_KEY.encode()).hexdigest(),
        "exploration": 0.5,
    }
    return {
        "HARNESSRL_PRODUCTION__APPS": json.dumps([app]),
        "HARNESSRL_PRODUCTION__IDLE_S": "10",
        "HARNESSRL_PRODUCTION__STORE": str((workdir / "sessions").resolve()),
        "HARNESSRL_PRODUCTION__FEEDBACK__WINDOW_S": str(WINDOW_S),
        "HARNESSRL_PRODUCTION__BASELINE__MIN_SESSIONS": "3",
        "HARNESSRL_REWARD__FEEDBACK_SWEEP_S": "1",
    }


@dataclass(slots=True)
class TrafficSession:
    """What the app was told about one session."""

    session_id: str
    answered: int = 0
    """Calls answered with a 200."""
    ended: bool = False
    signals: dict[str, float] = field(default_factory=dict)
    """Idempotency key -> value of the signals the feedback API accepted (202)."""
    refused: int = 0
    """Signals answered 409 (decided, window over): not counted anywhere."""


class ProductionTraffic:
    """Sessions at `rate` per second until `stop()`, then their feedback, to the end."""

    def __init__(self, gateway_url: str, feedback_url: str, *, rate: float, seed: int) -> None:
        self._gateway = gateway_url.rstrip("/")
        self._feedback = feedback_url.rstrip("/")
        self._rate = rate
        self._rng = random.Random(seed)
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.sessions: list[TrafficSession] = []
        self._auth = {"authorization": f"Bearer {APP_KEY}"}
        self._openai_client = openai.AsyncOpenAI(
            base_url=f"{self._gateway}/v1", api_key=APP_KEY, max_retries=SDK_RETRIES, timeout=60
        )
        self._anthropic_client = anthropic.AsyncAnthropic(
            base_url=self._gateway, api_key=APP_KEY, max_retries=SDK_RETRIES, timeout=60
        )

    def stop(self) -> None:
        """Open no new session; those under way finish (their feedback too)."""
        self._stop.set()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=30.0) as http:
            n = 0
            while not self._stop.is_set():
                record = TrafficSession(f"chaos-{n}")
                n += 1
                self.sessions.append(record)
                task = asyncio.create_task(self._session(http, record))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0 / self._rate)
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _session(self, http: httpx.AsyncClient, record: TrafficSession) -> None:
        """One user's conversation: on the openai SDK (the session in a header) or, every
        other one, the anthropic SDK (the session in the base URL), as apps would; each
        SDK retries by itself while the gateway is away."""
        question = self._rng.choice(_QUESTIONS)
        ask = self._openai if self._rng.random() < 0.5 else self._anthropic
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        for _ in range(self._rng.randint(1, 3)):
            try:
                reply = await ask(record.session_id, messages)
            except (openai.APIError, anthropic.APIError) as err:
                log.info("chaos traffic: a call was not answered", error=type(err).__name__)
                break
            record.answered += 1
            messages += [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "Thanks. Are you sure?"},
            ]
        ended = await self._send(
            http, "POST", f"{self._gateway}/sessions/{record.session_id}/end", self._auth, None
        )
        record.ended = ended is not None and ended.status_code == 200
        if self._rng.random() < 0.2:
            return  # this user never says anything
        await asyncio.sleep(self._rng.expovariate(1 / 3.0))
        value = 1.0 if self._rng.random() < 0.5 else -1.0
        body = {
            "session": record.session_id,
            "name": "thumbs",
            "value": value,
            "idempotency_key": f"{record.session_id}-thumbs",
        }
        for _ in range(2 if self._rng.random() < 0.3 else 1):  # a retrying client
            sent = await self._send(http, "POST", f"{self._feedback}/v1/feedback", self._auth, body)
            if sent is not None and sent.status_code == 202:
                record.signals[body["idempotency_key"]] = value  # type: ignore[index]
            elif sent is not None and sent.status_code == 409:
                record.refused += 1

    async def _openai(self, session: str, messages: list[dict[str, Any]]) -> str:
        answer = await self._openai_client.chat.completions.create(
            model="chaos-desk",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=24,
            extra_headers={"x-harnessrl-session": session},
        )
        return answer.choices[0].message.content or ""

    async def _anthropic(self, session: str, messages: list[dict[str, Any]]) -> str:
        client = self._anthropic_client.with_options(base_url=f"{self._gateway}/s/{session}")
        answer = await client.messages.create(
            model="chaos-desk",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=24,
        )
        return "".join(b.text for b in answer.content if b.type == "text") or "?"

    async def _send(
        self,
        http: httpx.AsyncClient,
        method: str,
        url: str,
        headers: dict[str, str],
        body: dict[str, Any] | None,
    ) -> httpx.Response | None:
        """The response, retried while the service is away (connection errors, 5xx, 429,
        and a 404 from a feedback API that has not yet seen the session); None if it never
        came within RETRY_FOR_S."""
        deadline = time.monotonic() + RETRY_FOR_S
        delay = 0.2
        while time.monotonic() < deadline:
            try:
                response = await http.request(method, url, headers=headers, json=body)
            except httpx.HTTPError:
                response = None
            if response is not None and not _retried(response, url):
                return response
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
        log.warning("chaos traffic: a request never got through", url=url)
        return None


def _retried(response: httpx.Response, url: str) -> bool:
    """Whether the answer says "try again": the service is away, busy, or (the feedback
    API) has not yet seen the session's start."""
    status = response.status_code
    return status >= 500 or status == 429 or (status == 404 and "/v1/feedback" in url)
