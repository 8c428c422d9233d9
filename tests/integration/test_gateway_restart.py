"""A gateway SIGKILLed in the middle of episodes: after the restart their calls go on at the
next seq, a closed episode stays closed, and a call answered just before the kill (the
broker frozen, so it was only in the gateway's spill log) still reaches hrl.calls.

The gateway runs as its own process (so the kill is real) with a fixed instance name and
spill directory, in front of the calculator stand-in engine (bench/calculator_standin.py).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harnessrl import events
from harnessrl.bench import calculator_standin
from harnessrl.broker import EmbeddedBroker, free_ports
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import KafkaSettings
from harnessrl.episode_token import EpisodeClaims, mint

pytestmark = pytest.mark.integration

SECRET = "restart-test-secret-0123456789abcdef"
ADMIN = "restart-test-admin-0123456789abcdef"
QUESTION: list[Any] = [{"role": "user", "content": "What is 12 plus 30?"}]


class Gateway:
    """`harnessrl gateway` as a child process, named `instance` (its spill directory under
    `tmp` too), answering as gateway replica `replica`."""

    def __init__(
        self,
        bootstrap: str,
        engine_port: int,
        port: int,
        tmp: Path,
        *,
        instance: str = "gw-restart",
        replica: str = "",
    ) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.replica = replica
        self._argv = [
            *(sys.executable, "-m", "harnessrl", "gateway", "--port", str(port)),
            *("--engine", f"http://127.0.0.1:{engine_port}", "--bootstrap", bootstrap),
        ]
        self._env = {
            **os.environ,
            "HARNESSRL_GATEWAY__TOKEN_SECRET": SECRET,
            "HARNESSRL_GATEWAY__ADMIN_TOKEN": ADMIN,
            "HARNESSRL_GATEWAY__PAUSE_HOLD_S": "30",
            "HARNESSRL_INSTANCE": instance,
            "HARNESSRL_GATEWAY__REPLICA": replica,
            "HARNESSRL_PRODUCER__SPILL_DIR": str(tmp / f"spill-{instance}"),
        }
        self._log = tmp / f"{instance}.log"
        self.process: subprocess.Popen[bytes] | None = None

    async def start(self) -> None:
        with self._log.open("ab") as log:
            self.process = subprocess.Popen(
                self._argv, env=self._env, stdout=subprocess.DEVNULL, stderr=log
            )
        async with httpx.AsyncClient() as http:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert self.process.poll() is None, self._log.read_text()[-3000:]
                try:
                    if (await http.get(f"{self.url}/healthz")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"gateway not healthy:\n{self._log.read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    async def close(self, episode: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(
                f"{self.url}/admin/episodes/{episode}/close",
                headers={"authorization": f"Bearer {ADMIN}"},
                json={"attempt": 1, "group_id": f"g-{episode}"},
            )

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


@pytest.fixture
async def gateway(broker: EmbeddedBroker, tmp_path: Path) -> AsyncIterator[Gateway]:
    engine_port, port = free_ports(2)
    standin = multiprocessing.get_context("spawn").Process(
        target=calculator_standin.serve, args=(engine_port,), daemon=True
    )
    standin.start()
    gw = Gateway(broker.bootstrap, engine_port, port, tmp_path)
    try:
        await gw.start()
        yield gw
    finally:
        gw.stop()
        standin.terminate()
        standin.join(10)


def token(episode: str) -> str:
    claims = EpisodeClaims(episode, 1, f"g-{episode}", "train", time.time() + 3600)
    return mint(claims, SECRET.encode())


async def ask(gateway: Gateway, tok: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=tok, max_retries=8)
    reply = await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=16)
    assert reply.choices


async def calls_of(broker: EmbeddedBroker, episode: str) -> tuple[list[int], list[int]]:
    """(seqs of the episode's ModelCalls, call_counts of its EpisodeCloseds) on hrl.calls,
    each once: a restarted gateway may send again what its spill log had not yet marked as
    sent (at least once; the ids make the copies harmless), never something different."""
    seqs: dict[int, tuple[int, ...]] = {}
    closed: set[int] = set()
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    async for kind, event, _ in read_to_end(kafka, events.CALLS, client_id="restart-test"):
        if getattr(event, "episode_id", None) != episode:
            continue
        if kind == "model_call":
            tokens = tuple(event.completion_token_ids)  # type: ignore[attr-defined]
            seq = event.seq  # type: ignore[attr-defined]
            assert seqs.setdefault(seq, tokens) == tokens, f"seq {seq} handed out twice"
        elif kind == "episode_closed":
            closed.add(event.call_count)  # type: ignore[attr-defined]
    return sorted(seqs), sorted(closed)


async def test_calls_go_on_at_the_next_seq_and_closed_stays_closed(
    broker: EmbeddedBroker, gateway: Gateway
) -> None:
    episode = "ep-restart"
    tok = token(episode)
    await ask(gateway, tok)
    await ask(gateway, tok)
    gateway.kill()
    await gateway.start()
    await ask(gateway, tok)  # the third call of the episode: seq 2, not 0 again
    response = await gateway.close(episode)
    assert response.status_code == 200, response.text
    assert response.json()["call_count"] == 3
    assert await calls_of(broker, "ep-restart") == ([0, 1, 2], [3])

    gateway.kill()
    await gateway.start()
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=tok, max_retries=0)
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(model="m", messages=QUESTION, max_tokens=4)
    assert refused.value.status_code == 409  # closed before the restart, closed after
    again = await gateway.close(episode)  # idempotent, with the count it was closed with
    assert again.status_code == 200 and again.json()["call_count"] == 3
    assert await calls_of(broker, "ep-restart") == ([0, 1, 2], [3])


async def test_a_call_answered_just_before_the_kill_is_delivered_after_the_restart(
    broker: EmbeddedBroker, gateway: Gateway
) -> None:
    episode = "ep-wal"
    tok = token(episode)
    await ask(gateway, tok)
    assert await calls_of(broker, "ep-wal") == ([0], [])
    os.kill(broker.pid, signal.SIGSTOP)  # nothing leaves the gateway now
    try:
        await ask(gateway, tok)  # answered: its ModelCall is only in the spill log
        gateway.kill()
    finally:
        os.kill(broker.pid, signal.SIGCONT)
    await gateway.start()  # sends what the killed one spilled, then recovers
    await ask(gateway, tok)
    response = await gateway.close(episode)
    assert response.json()["call_count"] == 3
    assert await calls_of(broker, "ep-wal") == ([0, 1, 2], [3])
