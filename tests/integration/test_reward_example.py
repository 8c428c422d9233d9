"""The example reward server (examples/reward_service/server.py), run as a user runs it.

Each test starts the server as its own process on a free port and calls Score over real
gRPC with the generated stubs.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from harnessrl.v1 import events_pb2, reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "examples" / "reward_service" / "server.py"
START_TIMEOUT_S = 30.0

PARIS = {"answer": "Paris", "keywords": ["paris", "capital", "France", "Seine"]}


@dataclass
class RunningServer:
    process: asyncio.subprocess.Process
    address: str


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RunningServer]:
    """The example server on a free loopback port; killed by handle if a test left it up."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SERVER),
        "--port",
        "0",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert process.stderr is not None
        line = await asyncio.wait_for(process.stderr.readline(), START_TIMEOUT_S)
        text = line.decode().rstrip("\n")
        assert text.startswith("listening on 127.0.0.1:"), text
        yield RunningServer(process, text.removeprefix("listening on "))
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest_asyncio.fixture
async def stub(server: RunningServer) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        yield reward_pb2_grpc.RewardStub(channel)


def request(
    answer: object = "Paris",
    metadata: object = PARIS,
    status: events_pb2.EpisodeStatus.ValueType = events_pb2.EPISODE_STATUS_SUCCEEDED,
    result_json: str | None = None,
    metadata_json: str | None = None,
) -> reward_pb2.ScoreRequest:
    episode = events_pb2.EpisodeFinished(
        episode_id="ep-1",
        attempt=1,
        group_id="g-1",
        task_id="capital-of-france",
        status=status,
        result_json=json.dumps({"answer": answer}) if result_json is None else result_json,
        task_metadata_json=json.dumps(metadata) if metadata_json is None else metadata_json,
        final=True,
    )
    return reward_pb2.ScoreRequest(episode=episode)


async def test_an_exact_answer_scores_one_after_normalisation(stub: Any) -> None:
    response = await stub.Score(request(answer="  paris! "), timeout=10)
    assert response.value == 1.0
    assert response.components["exact"] == 1.0
    assert list(response.flags) == []


async def test_a_partial_answer_scores_half_the_keyword_fraction(stub: Any) -> None:
    # "paris" and "capital" are present; "french" is not the keyword "france".
    response = await stub.Score(request(answer="It is Paris, the French capital."), timeout=10)
    assert response.value == pytest.approx(0.5 * 2 / 4)
    assert dict(response.components) == {"exact": 0.0, "keywords": 0.5}
    assert list(response.flags) == []


async def test_an_episode_that_did_not_succeed_scores_zero_with_its_reason(stub: Any) -> None:
    req = request(status=events_pb2.EPISODE_STATUS_FAILED)
    req.episode.reason = "exit code 3"
    response = await stub.Score(req, timeout=10)
    assert response.value == 0.0
    assert "EPISODE_STATUS_FAILED" in response.message
    assert "exit code 3" in response.message


@pytest.mark.parametrize(
    "result_json", ["", "{not json", '{"output": "Paris"}', '{"answer": null}', '{"answer": "?!"}']
)
async def test_a_result_without_an_answer_is_flagged_no_answer(stub: Any, result_json: str) -> None:
    response = await stub.Score(request(result_json=result_json), timeout=10)
    assert response.value == 0.0
    assert list(response.flags) == ["no_answer"]


@pytest.mark.parametrize(
    ("metadata_json", "reason"),
    [
        ("{broken", "not JSON"),
        ('["Paris"]', "must be a JSON object"),
        ('{"keywords": ["paris"]}', '"answer"'),
        ('{"answer": "Paris", "keywords": "paris"}', '"keywords"'),
    ],
)
async def test_malformed_task_metadata_is_invalid_argument_naming_the_field(
    stub: Any, metadata_json: str, reason: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Score(request(metadata_json=metadata_json), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("task_metadata_json: ")
    assert reason in caught.value.details()


async def test_a_keyword_stuffed_answer_is_flagged_and_scores_zero(stub: Any) -> None:
    stuffed = " ".join(["Paris capital France Seine"] * 100)
    response = await stub.Score(request(answer=stuffed), timeout=10)
    assert response.value == 0.0
    assert list(response.flags) == ["answer_too_long"]


async def test_the_same_request_gets_the_same_response(stub: Any) -> None:
    req = request(answer="Paris is on the Seine")
    first = await stub.Score(req, timeout=10)
    second = await stub.Score(req, timeout=10)
    assert first == second
    assert first.value == pytest.approx(0.5 * 2 / 4)


async def test_sigterm_stops_the_server_with_exit_code_zero(server: RunningServer) -> None:
    async with grpc.aio.insecure_channel(server.address) as channel:
        await reward_pb2_grpc.RewardStub(channel).Score(request(), timeout=10)
    server.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(server.process.wait(), 15) == 0
    assert server.process.stdout is not None
    assert await server.process.stdout.read() == b""
