"""Security cases against the real gateway on loopback, the project's engine (the tiny model)
and the real embedded broker, where capture really publishes.

Every refused case is checked twice: for its answer (status, and the error shape of the API
it was sent to) and for its effect. Nothing is captured for it: at the end each episode a
case named is closed with the real admin token, the gateway's own count of its calls must be
what the valid calls made, and hrl.calls must hold exactly those ModelCalls and only the
EpisodeClosed events the test published. No episode state changed (the episode a refused
request aimed at still takes calls), no pause was applied.

Also here: the harness's environment (local runs, forked runs, Kubernetes Jobs) and secrets
in logs, metrics, health, spans and `harnessrl config show`. That harness pods can reach
only the gateway and DNS (the NetworkPolicy) is checked in tests/unit/test_deploy_k8s.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import os
import re
import socket
import sys
import textwrap
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
import yaml
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import SecretStr

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings, TelemetrySettings
from harnessrl.episode_token import EpisodeClaims, mint, verify
from harnessrl.logs import JsonFormatter
from harnessrl.runtime import Runtime
from harnessrl.services.controller.config import (
    ControllerConfig,
    ControllerSection,
    HarnessSpec,
    KubernetesSettings,
)
from harnessrl.services.controller.service import ControllerService
from harnessrl.telemetry import create_tracer_provider
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, eventually
from tests.integration.gateway_stack import ADMIN, SECRET, Stack, running_stack
from tests.k8s_standin import KubeStandin
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration

LIMIT = 64 * 1024  # gateway.max_body_bytes of these tests
QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
CHAT = {"model": "m", "messages": QUESTION, "max_tokens": 2}
MESSAGES = {"model": "claude-x", "max_tokens": 2, "messages": QUESTION}
AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest_asyncio.fixture
async def stack(broker: EmbeddedBroker, tmp_path: Path) -> AsyncIterator[Stack]:
    async with running_stack(
        broker, tmp_path, TINY, max_body_bytes=LIMIT, pause_hold_s=0.2
    ) as running:
        yield running


# -- what the gateway answered, and what it captured --------------------------------------


def openai_refusal(response: httpx.Response, status: int, kind: str) -> str:
    """The message of an OpenAI-shaped error with `status` and error type `kind`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and set(error) == {"message", "type", "param", "code"}
    return str(error["message"])


def anthropic_refusal(response: httpx.Response, status: int, kind: str) -> str:
    """The message of an Anthropic-shaped error with `status` and error type `kind`."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    return str(body["error"]["message"])


def admin_refusal(response: httpx.Response) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "admin_error" and "Bearer <admin token>" in error["message"]


async def on_calls_topic(stack: Stack) -> list[tuple[str, Any]]:
    """(kind, event) of everything on hrl.calls now."""
    kafka = KafkaSettings(bootstrap_servers=stack.broker.bootstrap)
    return [
        (kind, event)
        async for kind, event, _ in read_to_end(kafka, events.CALLS, client_id="test-security")
    ]


async def model_calls(stack: Stack) -> Counter[tuple[str, int]]:
    found = await on_calls_topic(stack)
    return Counter((e.episode_id, e.attempt) for kind, e in found if kind == "model_call")


async def close_and_check(stack: Stack, expected: dict[tuple[str, int], int]) -> None:
    """Close each (episode, attempt) of `expected` with the admin token; the gateway must
    count exactly the expected calls of each, and hrl.calls must then hold exactly those
    ModelCalls and these EpisodeClosed, nothing else (their acks came before the answers)."""
    async with httpx.AsyncClient(base_url=stack.admin_url) as http:
        for (episode, attempt), count in expected.items():
            closed = await http.post(
                f"/admin/episodes/{episode}/close",
                headers=AUTH,
                json={"attempt": attempt, "group_id": "g-1"},
            )
            assert closed.status_code == 200, closed.text
            assert closed.json()["call_count"] == count, (episode, attempt)
    found = await on_calls_topic(stack)
    calls = Counter((e.episode_id, e.attempt) for kind, e in found if kind == "model_call")
    closes = sorted((e.episode_id, e.attempt, e.call_count) for k, e in found if k != "model_call")
    assert calls == {key: n for key, n in expected.items() if n}
    assert closes == sorted((*key, n) for key, n in expected.items())


def port(stack: Stack) -> int:
    return int(stack.gateway_url.rsplit(":", 1)[1])


def refused(stack: Stack, reason: str) -> float:
    value = stack.registry.get_sample_value("harnessrl_gateway_refused_total", {"reason": reason})
    return value or 0.0


def tampered(token: str, **claims: object) -> str:
    """`token` with claims changed in its payload, under its old MAC."""
    payload, mac = token.split(".")
    data = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data.update(claims)
    return base64.urlsafe_b64encode(orjson.dumps(data)).rstrip(b"=").decode() + "." + mac


# -- tokens ------------------------------------------------------------------------------


async def test_forged_altered_and_malformed_tokens_are_refused_on_every_route(
    stack: Stack,
) -> None:
    valid = stack.token("ep-1")
    payload = valid.split(".")[0]
    other_key = b"not-the-gateway-secret-0123456789"
    bad = {
        "signed with another key": mint(
            EpisodeClaims("ep-1", 1, "g-1", "train", time.time() + 300), other_key
        ),
        "episode id altered": tampered(valid, e="ep-2"),
        "attempt altered": tampered(valid, a=2),
        "group altered": tampered(valid, g="g-2"),
        "mode altered": tampered(valid, m="val"),
        "expiry extended": tampered(stack.token("ep-1", ttl=-60), x=time.time() + 3600),
        "MAC truncated": valid[:-1],
        "MAC missing (alg none)": payload + ".",
        "payload only": payload,
        "JWT-shaped, with a header": "eyJhbGciOiJub25lIn0." + valid,
        "characters appended": valid + "!!",
        "garbage": "garbage",
        "empty": "",
    }
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        for case, token in bad.items():
            bearer = {"authorization": f"Bearer {token}"} if token else {}
            for response in (
                await http.post(f"/e/{token}/v1/chat/completions", json=CHAT),
                await http.post("/v1/chat/completions", json=CHAT, headers=bearer),
            ):
                assert openai_refusal(response, 401, "authentication_error"), case
            for response in (
                await http.post(f"/e/{token}/v1/messages", json=MESSAGES),
                await http.post("/v1/messages", json=MESSAGES, headers={"x-api-key": token}),
            ):
                assert anthropic_refusal(response, 401, "authentication_error"), case
        # The episode the forgeries named is untouched: its own token still works.
        assert (await http.post(f"/e/{valid}/v1/chat/completions", json=CHAT)).status_code == 200
    reasons = ("forged", "malformed", "missing", "expired")
    assert sum(refused(stack, r) for r in reasons) == 4 * len(bad)
    await close_and_check(stack, {("ep-1", 1): 1, ("ep-2", 1): 0, ("ep-1", 2): 0})


async def test_a_token_is_refused_from_its_expiry_on_even_after_it_was_accepted(
    stack: Stack,
) -> None:
    expires_at = time.time() + 2.0
    token = mint(EpisodeClaims("ep-exp", 1, "g-1", "train", expires_at), SECRET.encode())
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        assert (await http.post(f"/e/{token}/v1/chat/completions", json=CHAT)).status_code == 200
        await asyncio.sleep(max(0.0, expires_at - time.time()) + 0.05)
        message = openai_refusal(
            await http.post(f"/e/{token}/v1/chat/completions", json=CHAT),
            401,
            "authentication_error",
        )
        assert "expired for episode ep-exp" in message
        anthropic_refusal(
            await http.post(f"/e/{token}/v1/messages", json=MESSAGES), 401, "authentication_error"
        )
        stale = stack.token("ep-stale", ttl=-1)
        openai_refusal(
            await http.post(f"/e/{stale}/v1/chat/completions", json=CHAT),
            401,
            "authentication_error",
        )
    assert refused(stack, "expired") == 3
    await close_and_check(stack, {("ep-exp", 1): 1, ("ep-stale", 1): 0})


async def test_a_rotated_out_secret_works_while_listed_and_is_refused_once_dropped(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    old = "previous-token-secret-0123456789"
    token = mint(EpisodeClaims("ep-rot", 1, "g-1", "train", time.time() + 300), old.encode())
    async with running_stack(
        broker, tmp_path / "a", TINY, previous_token_secrets=[SecretStr(old)]
    ) as stack:
        async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
            answer = await http.post(f"/e/{token}/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200
    assert await model_calls(stack) == {("ep-rot", 1): 1}
    async with running_stack(broker, tmp_path / "b", TINY) as stack:  # the rotation is over
        async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
            message = openai_refusal(
                await http.post(f"/e/{token}/v1/chat/completions", json=CHAT),
                401,
                "authentication_error",
            )
            assert "signature does not match" in message
            fresh = stack.token("ep-new")
            answer = await http.post(f"/e/{fresh}/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200
            closed = await http.post(
                "/admin/episodes/ep-new/close", headers=AUTH, json={"attempt": 1, "group_id": "g"}
            )
            assert closed.json()["call_count"] == 1  # acknowledged: the topic is complete
        assert await model_calls(stack) == {("ep-rot", 1): 1, ("ep-new", 1): 1}


async def test_another_episodes_token_as_the_api_key_is_refused_and_mode_is_the_tokens(
    stack: Stack,
) -> None:
    mine, theirs, my_retry = stack.token("ep-a"), stack.token("ep-b"), stack.token("ep-a", 2)
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        for key in (theirs, my_retry):
            openai_refusal(
                await http.post(
                    f"/e/{mine}/v1/chat/completions",
                    json=CHAT,
                    headers={"authorization": f"Bearer {key}"},
                ),
                403,
                "permission_error",
            )
            answer = await http.post(
                f"/e/{mine}/v1/messages", json=MESSAGES, headers={"x-api-key": key}
            )
            anthropic_refusal(answer, 403, "permission_error")
        # Its own token again, or any key that is no token (SDKs always send one), is fine.
        for key in (mine, "sk-anything"):
            answer = await http.post(
                f"/e/{mine}/v1/chat/completions",
                json={**CHAT, "temperature": 0},
                headers={"authorization": f"Bearer {key}"},
            )
            assert answer.status_code == 200
        # The mode is the token's: a val token keeps the harness's sampling, a train token
        # is sampled from the policy's own distribution whatever the harness asks.
        val = stack.token("ep-val", mode="val")
        answer = await http.post(f"/e/{val}/v1/chat/completions", json={**CHAT, "temperature": 0})
        assert answer.status_code == 200
    assert refused(stack, "other_episode") == 4
    found = [e for kind, e in await on_calls_topic(stack) if kind == "model_call"]
    assert sorted((c.episode_id, c.mode, c.temperature) for c in found) == [
        ("ep-a", pb.MODE_TRAIN, 1.0),
        ("ep-a", pb.MODE_TRAIN, 1.0),
        ("ep-val", pb.MODE_VAL, 0.0),
    ]
    await close_and_check(stack, {("ep-a", 1): 2, ("ep-b", 1): 0, ("ep-a", 2): 0, ("ep-val", 1): 1})


# -- the admin API -----------------------------------------------------------------------

ADMIN_ROUTES = [
    ("POST", "/admin/episodes/ep-v/close", {"attempt": 1, "group_id": "g-1"}),
    ("POST", "/admin/pause", {"reason": "not the controller"}),
    ("POST", "/admin/resume", {}),
    ("POST", "/admin/drain", {"timeout_s": 1}),
    ("GET", "/admin/status", None),
    ("POST", "/admin/no-such-route", {}),
]


def wrong_credentials(episode_token: str) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """(headers, query) of every credential that is not `Authorization: Bearer <admin>`."""
    basic = base64.b64encode(f"admin:{ADMIN}".encode()).decode()
    return {
        "none": ({}, {}),
        "a wrong token": ({"authorization": "Bearer not-the-admin-token"}, {}),
        "an episode token": ({"authorization": f"Bearer {episode_token}"}, {}),
        "the token secret": ({"authorization": f"Bearer {SECRET}"}, {}),
        "the admin token cut short": ({"authorization": f"Bearer {ADMIN[:-1]}"}, {}),
        "the admin token extended": ({"authorization": f"Bearer {ADMIN}x"}, {}),
        "no scheme": ({"authorization": ADMIN}, {}),
        "Basic scheme": ({"authorization": f"Basic {basic}"}, {}),
        "Token scheme": ({"authorization": f"Token {ADMIN}"}, {}),
        "as x-api-key": ({"x-api-key": ADMIN}, {}),
        "in the query": ({}, {"token": ADMIN, "admin_token": ADMIN}),
    }


async def test_admin_routes_refuse_everything_but_the_admin_bearer_token(stack: Stack) -> None:
    token = stack.token("ep-v")
    credentials = wrong_credentials(token)

    async def status(http: httpx.AsyncClient) -> dict[str, Any]:
        answer = await http.get("/admin/status", headers=AUTH)
        assert answer.status_code == 200
        data: dict[str, Any] = answer.json()
        return data

    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        assert (await http.post(f"/e/{token}/v1/chat/completions", json=CHAT)).status_code == 200
        for headers, query in credentials.values():
            for method, path, body in ADMIN_ROUTES:
                answer = await http.request(method, path, headers=headers, params=query, json=body)
                admin_refusal(answer)
        assert (await status(http))["paused"] is False  # no forged pause took
        # Paused by the admin token, a forged resume does not resume.
        assert (await http.post("/admin/pause", headers=AUTH, json={})).status_code == 200
        for headers, query in credentials.values():
            admin_refusal(await http.post("/admin/resume", headers=headers, params=query, json={}))
        assert (await status(http))["paused"] is True
        assert (await http.post("/admin/resume", headers=AUTH, json={})).status_code == 200
        # No forged close took: the episode still takes calls.
        assert (await http.post(f"/e/{token}/v1/chat/completions", json=CHAT)).status_code == 200
    assert refused(stack, "admin_auth") == len(credentials) * (len(ADMIN_ROUTES) + 1)
    await close_and_check(stack, {("ep-v", 1): 2})


async def test_with_an_admin_port_the_admin_api_is_there_and_only_there(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """`gateway.admin_port`: the harness port has no admin API at all (404, even with the
    admin token), the admin port no harness API; so a NetworkPolicy on the harness port
    keeps harnesses off the admin API whatever they hold."""
    async with running_stack(broker, tmp_path, TINY, admin_port=0) as stack:
        assert stack.gateway.admin_port not in (0, port(stack))
        token = stack.token("ep-p")
        harness_side = httpx.AsyncClient(base_url=stack.gateway_url)
        admin_side = httpx.AsyncClient(base_url=stack.admin_url)
        async with harness_side, admin_side:
            for method, path, body in ADMIN_ROUTES:
                answer = await harness_side.request(method, path, headers=AUTH, json=body)
                openai_refusal(answer, 404, "not_found_error")
            bearer = {"authorization": f"Bearer {token}"}
            for path in (f"/e/{token}/v1/chat/completions", "/v1/chat/completions"):
                answer = await admin_side.post(path, headers=bearer, json=CHAT)
                openai_refusal(answer, 404, "not_found_error")
            assert (await admin_side.get("/openapi.json")).status_code == 404
            for headers, query in wrong_credentials(token).values():
                admin_refusal(await admin_side.get("/admin/status", headers=headers, params=query))
            assert (await admin_side.get("/admin/status", headers=AUTH)).json()["paused"] is False
            for side in (harness_side, admin_side):
                assert (await side.get("/healthz")).status_code == 200
                assert "harnessrl_gateway_calls_total" in (await side.get("/metrics")).text
            answer = await harness_side.post(f"/e/{token}/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200, answer.text
        await close_and_check(stack, {("ep-p", 1): 1})


# -- oversized requests ------------------------------------------------------------------


async def exchange(stack: Stack, data: bytes) -> tuple[int, bytes, bool]:
    """(status, body, whether the server then closed) for raw request bytes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port(stack))
    writer.write(data)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        closed = await asyncio.wait_for(reader.read(), 10) == b""
    finally:
        writer.close()
    return int(head.split()[1]), body, closed


async def test_oversized_bodies_and_heads_are_refused_before_anything_is_forwarded(
    stack: Stack,
) -> None:
    token = stack.token("ep-big")
    route = f"/e/{token}/v1/chat/completions"

    async def chunked() -> AsyncIterator[bytes]:
        for _ in range(5):
            yield b" " * (16 * 1024)

    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        declared = await http.post(route, content=b" " * (LIMIT + 1))
        assert "too large" in openai_refusal(declared, 413, "invalid_request_error")
        assert declared.headers["connection"] == "close"
        undeclared = await http.post(route, content=chunked())
        assert "too large" in openai_refusal(undeclared, 413, "invalid_request_error")
        # On the Anthropic route too, in Anthropic's shape.
        anthropic = await http.post(f"/e/{token}/v1/messages", content=b" " * (LIMIT + 1))
        assert "too large" in anthropic_refusal(anthropic, 413, "request_too_large")
        # A body of exactly the limit is a call like any other.
        exact = orjson.dumps(CHAT)
        exact += b" " * (LIMIT - len(exact))
        answer = await http.post(route, content=exact, headers={"content-type": "application/json"})
        assert answer.status_code == 200
    start = f"POST {route} HTTP/1.1\r\nhost: gw\r\ncontent-length: 2\r\n".encode()
    big_head = start + b"x-big: " + b"a" * LIMIT + b"\r\n\r\n{}"
    many_heads = start + b"x-h: v\r\n" * 10_000 + b"\r\n{}"  # 80 KiB of small headers
    for data in (big_head, many_heads):
        status, body, closed = await exchange(stack, data)
        assert (status, closed) == (431, True)
        assert orjson.loads(body)["error"]["type"] == "invalid_request_error"  # a 4xx
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        assert (await http.post(route, json=CHAT)).status_code == 200
    await close_and_check(stack, {("ep-big", 1): 2})


# -- slow clients ------------------------------------------------------------------------


async def trickle(writer: asyncio.StreamWriter, head: bytes, byte: bytes, seconds: float) -> None:
    """Send `head`, then `byte` every 0.2 s for `seconds` (or until the server closes)."""
    writer.write(head)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not writer.is_closing():
        await asyncio.sleep(0.2)
        writer.write(byte)
        try:
            await writer.drain()
        except ConnectionError:
            return


async def cut_off(stack: Stack, head: bytes, byte: bytes) -> int:
    """The status a client gets that sends `head`, then trickles `byte` for 20 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port(stack))
    sender = asyncio.create_task(trickle(writer, head, byte, 20.0))
    try:
        answer = await asyncio.wait_for(reader.read(), 15)  # the server ends it long before
    finally:
        sender.cancel()
        writer.close()
    status = int(answer.split()[1])
    body = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["message"] == "request timeout"
    return status


async def test_slow_clients_are_cut_off_without_holding_up_other_clients(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    # Short deadlines (10 s and 30 s by default): the behaviour under test is that
    # trickling bytes never extends them.
    async with running_stack(
        broker, tmp_path, TINY, header_timeout_s=1.0, body_timeout_s=1.0
    ) as stack:
        token, other = stack.token("ep-slow"), stack.token("ep-other")
        route = f"/e/{token}/v1/chat/completions"
        slowloris = [
            cut_off(stack, f"POST {route} HTTP/1.1\r\nhost: gw\r\nx-slow: ".encode(), b"a")
            for _ in range(20)
        ]
        slow_body = cut_off(
            stack,
            f"POST {route} HTTP/1.1\r\nhost: gw\r\ncontent-length: 200\r\n\r\n{{".encode(),
            b" ",
        )
        async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
            meanwhile = http.post(f"/e/{other}/v1/chat/completions", json=CHAT)
            *statuses, answer = await asyncio.gather(*slowloris, slow_body, meanwhile)
        assert statuses == [408] * 21
        assert answer.status_code == 200
        await close_and_check(stack, {("ep-slow", 1): 0, ("ep-other", 1): 1})


async def test_a_client_that_never_reads_its_stream_holds_only_its_own_call(
    stack: Stack,
) -> None:
    """Backpressure, not buffering: the gateway reads the engine's stream only as fast as
    the client reads it, so a stream nobody reads is never completed (nor captured), and
    other clients are served meanwhile."""
    body = {
        "model": "m",
        "messages": QUESTION,
        "max_tokens": 600,
        "temperature": 0,  # greedy: the tiny model runs to max_tokens (~1 MB of SSE)
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    stuck = stack.token("ep-stuck", mode="val")
    sock = socket.socket()
    # A small receive window and segment size, so that kernel buffers hold little of it.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port(stack)))
    data = orjson.dumps(body)
    await loop.sock_sendall(
        sock,
        f"POST /e/{stuck}/v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
        f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n".encode()
        + data,
    )
    try:
        async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60) as http:
            # The same stream read by another client runs to its end, captured.
            reader = stack.token("ep-reader", mode="val")
            async with http.stream(
                "POST", f"/e/{reader}/v1/chat/completions", json=body
            ) as streamed:
                size = sum([len(chunk) async for chunk in streamed.aiter_bytes()])
            assert streamed.status_code == 200 and size > 500_000
            quick = await http.post(f"/e/{stack.token('ep-quick')}/v1/chat/completions", json=CHAT)
            assert quick.status_code == 200
            assert await model_calls(stack) == {("ep-reader", 1): 1, ("ep-quick", 1): 1}
            status = (await http.get("/admin/status", headers=AUTH)).json()
            assert status["in_flight"] == 1  # the unread stream, held back
    finally:
        sock.close()
    async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
        for _ in range(100):
            if (await http.get("/admin/status", headers=AUTH)).json()["in_flight"] == 0:
                break
            await asyncio.sleep(0.1)
        assert (await http.get("/admin/status", headers=AUTH)).json()["in_flight"] == 0
    await close_and_check(stack, {("ep-stuck", 1): 0, ("ep-reader", 1): 1, ("ep-quick", 1): 1})


# -- the controller: what a harness gets, what the services write ------------------------

ROOT = Path(__file__).resolve().parents[2]
DUMP_ENV = """
import sys
forked = "email.parser" in sys.modules  # preloaded by the fork server, else never imported
import json, os
proc = open("/proc/self/environ", "rb").read().decode("utf-8", "replace")
print("HARNESSRL_RESULT " + json.dumps(
    {"env": dict(os.environ), "proc": proc.split("\\0"), "forked": forked}))
"""
CALL_GATEWAY = """
import json, os, urllib.request
request = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 2}).encode(),
    headers={"content-type": "application/json",
             "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
)
with urllib.request.urlopen(request) as answer:
    print("HARNESSRL_RESULT " + json.dumps({"status": answer.status,
                                            "token": os.environ["OPENAI_API_KEY"]}))
"""


def harness(tmp_path: Path, name: str, code: str, **spec: Any) -> HarnessSpec:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(code))
    return HarnessSpec(command=[sys.executable, str(script)], timeout_s=30, **spec)


@asynccontextmanager
async def controller(
    stack: Stack, tmp_path: Path, tracer_provider: TracerProvider | None = None, **section: Any
) -> AsyncIterator[CollectorRegistry]:
    """A running controller (in this process) for `stack`'s gateway; yields its registry."""
    registry = CollectorRegistry()
    config = ControllerConfig(
        instance="ctl-0",
        kafka=KafkaSettings(bootstrap_servers=stack.broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "ctl-spill"),
        controller=ControllerSection(
            gateway_url=stack.gateway_url,
            token_secret=SecretStr(SECRET),
            admin_token=SecretStr(ADMIN),
            workdir=tmp_path / "episodes",
            state_dir=tmp_path / "controller",
            kill_grace_s=0.5,
            port=0,
            **section,
        ),
    )
    service = ControllerService(
        config, Runtime("controller", "ctl-0", registry, tracer_provider or TracerProvider())
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield registry
    finally:
        await service.stop()
        await task


async def submit(stack: Stack, tmp_path: Path, *families: str) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=stack.broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "submit"),
        name="submit/t",
    )
    await producer.start()
    for family in families:
        await producer.publish(
            pb.TaskSubmitted(
                task_id=f"t-{family}",
                group_id=f"g-{family}",
                split=pb.MODE_TRAIN,
                input_json='{"question": "2 + 2"}',
                group_size=1,
                metadata_json=json.dumps({"family": family}),
            )
        )
    await producer.stop()


async def finished(stack: Stack, count: int) -> list[pb.EpisodeFinished]:
    """The final EpisodeFinished events, once there are `count`."""
    kafka = KafkaSettings(bootstrap_servers=stack.broker.bootstrap)
    found: list[pb.EpisodeFinished] = []

    async def enough() -> bool:
        found[:] = [
            event
            async for kind, event, _ in read_to_end(kafka, events.EPISODES, client_id="test-sec")
            if kind == "episode_finished" and event.final  # type: ignore[attr-defined]
        ]
        return len(found) >= count

    await eventually(enough, timeout=60, interval=0.3)
    return found


def service_settings(env: dict[str, str]) -> list[str]:
    """Names of services' settings (`HARNESSRL_<SECTION>__<FIELD>`, HARNESSRL_CONFIG)."""
    return [k for k in env if k.startswith("HARNESSRL_") and ("__" in k or k == "HARNESSRL_CONFIG")]


def found_in(text: str, values: list[str]) -> list[str]:
    """Those of `values` in `text` (an address counts only with its whole port)."""
    return [v for v in values if re.search(re.escape(v) + r"(?!\d)", text)]


def check_harness_env(env: dict[str, str], stack: Stack, forbidden: list[str]) -> str:
    """Assert `env` holds the episode's gateway URLs and its own token and none of
    `forbidden`; returns the episode id the token is for."""
    token = env["OPENAI_API_KEY"]
    claims = verify(token, [SECRET.encode()])
    assert env["OPENAI_BASE_URL"] == f"{stack.gateway_url}/e/{token}/v1"
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"]) == (
        f"{stack.gateway_url}/e/{token}",
        token,
    )
    assert service_settings(env) == []
    text = json.dumps(env)
    assert found_in(text, forbidden) == []
    return claims.episode_id


async def test_the_harness_environment_is_its_gateway_url_and_token_and_nothing_more(
    broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reward_address = "reward.harnessrl.svc:50051"
    async with running_stack(broker, tmp_path, TINY) as stack:
        # The controller's own environment, as `harnessrl up` and the deployments set it.
        services = {
            "HARNESSRL_CONTROLLER__TOKEN_SECRET": SECRET,
            "HARNESSRL_CONTROLLER__ADMIN_TOKEN": ADMIN,
            "HARNESSRL_GATEWAY__ADMIN_TOKEN": ADMIN,
            "HARNESSRL_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap,
            "HARNESSRL_REWARD__SOURCE": f"grpc:{reward_address}",
        }
        for name, value in services.items():
            monkeypatch.setenv(name, value)
        forbidden = [SECRET, ADMIN, broker.bootstrap, reward_address]
        families = {
            "executed": harness(tmp_path, "executed", DUMP_ENV),
            "forked": harness(tmp_path, "forked", DUMP_ENV, preload=["email.parser"]),
        }
        async with controller(stack, tmp_path, families=families):
            await submit(stack, tmp_path, *families)
            runs = await finished(stack, 2)
        for run in runs:
            seen = orjson.loads(run.result_json)
            assert seen["forked"] == (run.group_id == "g-forked")
            assert check_harness_env(seen["env"], stack, forbidden) == run.episode_id
            start = dict(v.split("=", 1) for v in seen["proc"] if "=" in v)  # as exec'd
            assert service_settings(start) == []
            assert found_in(json.dumps(start), forbidden) == []

        # The Kubernetes Job the controller makes, from the shipped template, in a stand-in
        # API server (no cluster runs here).
        kube = KubeStandin("harness")
        await kube.start()
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "c", "cluster": {"server": kube.url}}],
                    "users": [{"name": "u", "user": {}}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "current-context": "x",
                }
            )
        )
        settings = KubernetesSettings(
            namespace="harness",
            job_template=ROOT / "deploy" / "k8s" / "base" / "config" / "job-template.yaml",
            kubeconfig=kubeconfig,
            poll_interval_s=0.05,
        )
        try:
            async with controller(
                stack,
                tmp_path / "k8s",
                runner="kubernetes",
                kubernetes=settings,
                families={"on-kubernetes": HarnessSpec(command=["python", "agent.py"])},
            ):
                await submit(stack, tmp_path / "k8s", "on-kubernetes")
                await eventually(lambda: bool(kube.created), timeout=30)
        finally:
            await kube.stop()
    (job,) = kube.created
    pod = job["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False  # no Service addresses (reward, Kafka) in env
    assert pod["automountServiceAccountToken"] is False
    for container in pod["containers"]:
        assert "envFrom" not in container
        assert all(set(entry) == {"name", "value"} for entry in container["env"])
        env = {entry["name"]: entry["value"] for entry in container["env"]}
        episode = check_harness_env(env, stack, forbidden)
        assert episode == job["metadata"]["annotations"]["harnessrl/episode-id"]


@pytest.fixture
def log_lines() -> Iterator[io.StringIO]:
    """Every log record of this process meanwhile, as the services format them."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("test"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def config_show(service: str) -> str:
    env = {
        **os.environ,
        "HARNESSRL_GATEWAY__TOKEN_SECRET": SECRET,
        "HARNESSRL_GATEWAY__PREVIOUS_TOKEN_SECRETS": json.dumps(
            ["old-token-secret-0123456789abcdef01"]
        ),
        "HARNESSRL_GATEWAY__ADMIN_TOKEN": ADMIN,
        "HARNESSRL_CONTROLLER__TOKEN_SECRET": SECRET,
        "HARNESSRL_CONTROLLER__ADMIN_TOKEN": ADMIN,
        "HARNESSRL_KAFKA__SASL_PASSWORD": "kafka-password-0123",
    }
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "harnessrl.apps.cli",
        "config",
        "show",
        service,
        "--describe",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await process.communicate()
    assert process.returncode == 0, out
    return out.decode()


async def test_no_secret_nor_token_reaches_logs_metrics_health_spans_or_config_show(
    broker: EmbeddedBroker, tmp_path: Path, log_lines: io.StringIO
) -> None:
    spans = tmp_path / "traces.jsonl"
    provider = create_tracer_provider(
        "gateway", "gw-0", TelemetrySettings(exporter="jsonl", jsonl_path=spans)
    )
    shown = asyncio.gather(config_show("gateway"), config_show("controller"))
    async with running_stack(broker, tmp_path, TINY, tracer_provider=provider) as stack:
        async with controller(
            stack,
            tmp_path,
            provider,
            families={"call": harness(tmp_path, "call", CALL_GATEWAY)},
            inherit_env=["PATH", "HOME", "PYTHONPATH"],
        ) as registry:
            await submit(stack, tmp_path, "call")
            (run,) = await finished(stack, 1)
            controller_metrics = generate_latest(registry).decode()
        result = orjson.loads(run.result_json)
        assert result["status"] == 200
        mine = stack.token("ep-mine")
        forged = mint(EpisodeClaims("ep-f", 1, "g", "train", time.time() + 60), b"x" * 32)
        async with httpx.AsyncClient(base_url=stack.gateway_url) as http:
            bearer = {"authorization": f"Bearer {mine}"}
            assert (
                await http.post(f"/e/{mine}/v1/chat/completions", json=CHAT, headers=bearer)
            ).status_code == 200
            for path, headers, body in [
                (f"/e/{forged}/v1/chat/completions", {}, orjson.dumps(CHAT)),
                (f"/e/{mine}/v1/chat/completions", {}, b" " * (LIMIT + 1)),  # refused: logged
                (f"/e/{mine}/v1/embeddings", bearer, b"{}"),
                (f"/e/{result['token']}/v1/chat/completions", {}, orjson.dumps(CHAT)),  # closed
                ("/admin/pause", {"authorization": f"Bearer {mine}"}, b"{}"),
                ("/admin/pause", {"authorization": f"Token {ADMIN}"}, b"{}"),
            ]:
                assert (await http.post(path, headers=headers, content=body)).status_code >= 400
            gateway_metrics = (await http.get("/metrics")).text
            health = (await http.get("/healthz")).text
    provider.shutdown()
    logs = log_lines.getvalue()
    texts = {
        "logs": logs,
        "gateway /metrics": gateway_metrics,
        "gateway /healthz": health,
        "controller /metrics": controller_metrics,
        "spans": spans.read_text(),
        "config show": "\n".join(await shown),
    }
    credentials = [SECRET, ADMIN, "kafka-password-0123", "old-token-secret-0123456789abcdef01"]
    for token in (result["token"], mine, forged):
        credentials += [token, token.split(".")[1]]  # the whole token, and its MAC alone
    leaks = [(where, c) for where, text in texts.items() for c in credentials if c in text]
    assert leaks == []
    # ... and none of that is because nothing was written:
    assert "/e/**********/v1/chat/completions" in logs  # the 413, logged with its path masked
    assert '"msg":"episode closed"' in logs and "harnessrl_gateway_calls_total" in gateway_metrics
    assert '"name": "gateway chat"' in texts["spans"] or '"name":"gateway chat"' in texts["spans"]
    assert texts["config show"].count('"**********"') >= 6
