"""The controller end to end: real harnesses run by the local runner, through the real
gateway and engine, on the real broker; misbehaving harnesses; a controller killed mid-run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.runtime import Runtime
from harnessrl.services.controller.config import ControllerConfig, ControllerSection, HarnessSpec
from harnessrl.services.controller.service import ControllerService
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, eventually, read_topic, topic_size
from tests.integration.gateway_stack import ADMIN, SECRET, Stack, running_stack
from tests.integration.test_gateway import AFTER_TOOL, CALL_TEXT, QUESTION, TOOLS
from tests.model_helpers import overfit

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "integration" / "workers"


@pytest.fixture(scope="module")
def calc_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return overfit(
        tmp_path_factory.mktemp("calc-model"),
        [(QUESTION, TOOLS, CALL_TEXT), (AFTER_TOOL, TOOLS, "The answer is 42.")],
        steps=200,
    )


def _section(stack: Stack, tmp_path: Path, **overrides: Any) -> ControllerSection:
    settings: dict[str, Any] = {
        "harness": HarnessSpec(
            command=[sys.executable, str(WORKERS / "calc_harness.py")], timeout_s=60
        ),
        "families": {
            "odd": HarnessSpec(
                command=[sys.executable, str(WORKERS / "odd_harness.py")], timeout_s=2
            )
        },
        "gateway_url": stack.gateway_url,
        "token_secret": SecretStr(SECRET),
        "admin_token": SecretStr(ADMIN),
        "workdir": tmp_path / "episodes",
        "state_dir": tmp_path / "controller",
        "max_attempts": 2,
        "kill_grace_s": 0.5,
        "inherit_env": ["PATH", "HOME", "PYTHONPATH", "VIRTUAL_ENV"],
        "port": 0,
    } | overrides
    return ControllerSection(**settings)


@asynccontextmanager
async def controller(
    stack: Stack,
    tmp_path: Path,
    tracer_provider: TracerProvider | None = None,
    **overrides: Any,
) -> AsyncIterator[ControllerService]:
    config = ControllerConfig(
        instance="ctl-0",
        kafka=KafkaSettings(bootstrap_servers=stack.broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "ctl-spill"),
        controller=_section(stack, tmp_path, **overrides),
    )
    service = ControllerService(
        config,
        Runtime("controller", "ctl-0", CollectorRegistry(), tracer_provider or TracerProvider()),
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield service
    finally:
        await service.stop()
        await task


async def _submit(bootstrap: str, tmp_path: Path, *tasks: pb.TaskSubmitted) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=bootstrap),
        ProducerSettings(spill_dir=tmp_path / "submit"),
        name="submit/t",
    )
    await producer.start()
    for task in tasks:
        await producer.publish(task)
    await producer.stop()


def _task(
    group: str, input_: dict[str, Any], *, size: int = 1, family: str = "", split: int = pb.MODE_VAL
) -> pb.TaskSubmitted:
    metadata = {"family": family} if family else {}
    return pb.TaskSubmitted(
        task_id=group,
        group_id=group,
        split=split,  # type: ignore[arg-type]
        input_json=json.dumps(input_),
        group_size=size,
        metadata_json=json.dumps(metadata),
    )


async def _episodes(bootstrap: str) -> list[tuple[str, Any, Any]]:
    size = await topic_size(bootstrap, events.EPISODES)
    records = await read_topic(bootstrap, events.EPISODES, size) if size else []
    out = []
    for record in records:
        envelope = events.decode(events.EPISODES, record.value)
        kind = envelope.WhichOneof("event")
        out.append((kind, getattr(envelope, kind), record))
    return out


async def _finals(bootstrap: str, count: int, timeout: float = 90) -> list[pb.EpisodeFinished]:
    finals: list[pb.EpisodeFinished] = []

    async def enough() -> bool:
        finals[:] = [
            e for k, e, _ in await _episodes(bootstrap) if k == "episode_finished" and e.final
        ]
        return len(finals) >= count

    await eventually(enough, timeout=timeout, interval=0.3)
    return finals


@pytest.fixture
async def stack(broker: EmbeddedBroker, tmp_path: Path, calc_model: Path) -> AsyncIterator[Stack]:
    async with running_stack(broker, tmp_path, calc_model) as running:
        yield running


async def test_a_real_harness_runs_through_gateway_and_engine_with_consistent_events(
    stack: Stack,
    tmp_path: Path,
) -> None:
    async with controller(stack, tmp_path):
        await _submit(
            stack.broker.bootstrap,
            tmp_path,
            _task("g-calc", {"question": "What is 17 + 25?"}, size=2),
        )
        finals = await _finals(stack.broker.bootstrap, 2)
    events_ = await _episodes(stack.broker.bootstrap)
    started = [e for k, e, _ in events_ if k == "episode_started"]
    assert sorted((e.episode_id, e.attempt, e.index) for e in started) == [
        ("g-calc-0", 1, 0),
        ("g-calc-1", 1, 1),
    ]
    assert all(
        e.group_id == "g-calc" and e.group_size == 2 and e.runner == "local" and e.trace_id
        for e in started
    )
    calls = await stack.calls(at_least=4)
    closed = await stack.closed()
    for episode in ("g-calc-0", "g-calc-1"):
        mine = [c for c in calls if c.episode_id == episode]
        assert [c.seq for c in mine] == [0, 1] and all(c.group_id == "g-calc" for c in mine)
        assert [(c.call_count, c.attempt) for c in closed if c.episode_id == episode] == [(2, 1)]
        finished = next(f for f in finals if f.episode_id == episode)
        assert finished.status == pb.EPISODE_STATUS_SUCCEEDED and finished.exit_code == 0
        result = {"answer": "The answer is 42.", "calls": 2, "tools": 1}
        assert json.loads(finished.result_json) == result
        assert json.loads(finished.task_input_json) == {"question": "What is 17 + 25?"}
        assert finished.artifacts_uri.startswith("file://")
        # The calls were captured under the episode's trace.
        trace = next(e.trace_id for e in started if e.episode_id == episode)
        assert {c.trace_id for c in mine} == {trace}


async def test_a_hang_times_out_a_crash_is_retried_and_garbage_fails(
    stack: Stack,
    tmp_path: Path,
) -> None:
    async with controller(stack, tmp_path):
        await _submit(
            stack.broker.bootstrap,
            tmp_path,
            _task("g-hang", {"behaviour": "hang"}, family="odd"),
            _task("g-crash", {"behaviour": "crash"}, family="odd"),
            _task("g-garbage", {"behaviour": "garbage"}, family="odd"),
        )
        finals = {f.group_id: f for f in await _finals(stack.broker.bootstrap, 3)}
    assert finals["g-hang"].status == pb.EPISODE_STATUS_TIMEOUT
    assert "timeout" in finals["g-hang"].reason
    assert finals["g-crash"].status == pb.EPISODE_STATUS_FAILED
    assert finals["g-crash"].attempt == 2  # retried once (max_attempts 2), then final
    assert "killed by signal 9" in finals["g-crash"].reason
    assert finals["g-garbage"].status == pb.EPISODE_STATUS_FAILED
    assert finals["g-garbage"].attempt == 1 and "malformed result" in finals["g-garbage"].reason
    non_final = [
        e
        for k, e, _ in await _episodes(stack.broker.bootstrap)
        if k == "episode_finished" and not e.final
    ]
    assert [(e.group_id, e.attempt) for e in non_final] == [("g-crash", 1)]


async def test_a_task_missing_fields_goes_to_the_dlq_and_the_controller_goes_on(
    stack: Stack,
    tmp_path: Path,
) -> None:
    async with controller(stack, tmp_path):
        broken = pb.TaskSubmitted(task_id="t", group_id="g-broken", split=pb.MODE_VAL)
        await _submit(
            stack.broker.bootstrap,
            tmp_path,
            broken,
            _task("g-after", {"behaviour": "sleep", "seconds": 0}, family="odd"),
        )
        (final,) = await _finals(stack.broker.bootstrap, 1)
        assert final.group_id == "g-after"
    dead = await read_topic(stack.broker.bootstrap, events.DLQ, 1)
    assert (
        dict(dead[0].headers)["dlq.reason"] == b"PermanentError: TaskSubmitted.input_json: required"
    )


async def test_a_controller_killed_mid_run_leaves_no_episode_unaccounted_for(
    broker: EmbeddedBroker,
    tmp_path: Path,
    calc_model: Path,
) -> None:
    async with running_stack(broker, tmp_path, calc_model, engine_model="m") as stack:
        config = {
            "kafka": {"bootstrap_servers": broker.bootstrap, "partitions": 3},
            "consumer": FAST_GROUP,
            "producer": {"spill_dir": str(tmp_path / "spill")},
            "controller": {
                "harness": {
                    "command": [sys.executable, str(WORKERS / "odd_harness.py")],
                    "timeout_s": 30,
                },
                "gateway_url": stack.gateway_url,
                "token_secret": SECRET,
                "admin_token": ADMIN,
                "workdir": str(tmp_path / "episodes"),
                "state_dir": str(tmp_path / "controller"),
                "max_in_flight": 4,
                "max_attempts": 3,
                "kill_grace_s": 0.5,
                "port": 0,
                "inherit_env": ["PATH", "HOME", "PYTHONPATH", "VIRTUAL_ENV"],
            },
        }
        path = tmp_path / "controller.yaml"
        path.write_text(yaml.safe_dump(config))
        tasks = [_task(f"g-{i}", {"behaviour": "sleep", "seconds": 2}, size=2) for i in range(3)]
        await _submit(broker.bootstrap, tmp_path, *tasks)
        first = _start_controller(path, "ctl-a")
        try:
            await eventually(
                lambda: _started_at_least(broker.bootstrap, 3), timeout=60, interval=0.2
            )
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        second = _start_controller(path, "ctl-b")
        try:
            finals = await _finals(broker.bootstrap, 6, timeout=120)
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=60) == 0
    history = await _episodes(broker.bootstrap)
    started = {(e.episode_id, e.attempt) for k, e, _ in history if k == "episode_started"}
    finished = {(e.episode_id, e.attempt) for k, e, _ in history if k == "episode_finished"}
    assert started <= finished  # every attempt started was reported
    assert sorted(f.episode_id for f in finals) == sorted(
        f"g-{i}-{j}" for i in range(3) for j in range(2)
    )  # each episode final exactly once
    assert all(f.status == pb.EPISODE_STATUS_SUCCEEDED for f in finals)
    retried = [e for k, e, _ in history if k == "episode_finished" and not e.final]
    assert retried and all("controller restarted" in e.reason for e in retried)


def _start_controller(config: Path, instance: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "HARNESSRL_INSTANCE": instance, "HARNESSRL_LOG__LEVEL": "WARNING"}
    return subprocess.Popen(
        [sys.executable, "-m", "harnessrl", "controller", "--config", str(config)],
        cwd=ROOT,
        env=env,
    )


async def _started_at_least(bootstrap: str, count: int) -> bool:
    return sum(k == "episode_started" for k, _, _ in await _episodes(bootstrap)) >= count


async def test_sync_mode_starts_episodes_only_once_engines_serve_the_announced_version(
    stack: Stack,
    tmp_path: Path,
) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=stack.broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "trainer"),
        name="trainer/t",
    )
    await producer.start()
    async with controller(stack, tmp_path, schedule="sync") as service:
        await producer.publish(pb.PolicyVersion(version=1, step=1))

        async def announced() -> bool:  # a task consumed before the announcement would
            return service.admission is not None and service.admission.announced >= 1

        await eventually(announced, timeout=30, interval=0.1)  # start at version 0, rightly
        await _submit(
            stack.broker.bootstrap,
            tmp_path,
            _task("g-sync", {"behaviour": "sleep", "seconds": 0}, family="odd"),
        )
        await asyncio.sleep(3.0)
        assert not await _started_at_least(stack.broker.bootstrap, 1)  # engines not there yet
        await producer.publish(pb.PolicyLoaded(version=1, engine="engine-0", ok=True))
        (final,) = await _finals(stack.broker.bootstrap, 1)
    await producer.stop()
    started = [e for k, e, _ in await _episodes(stack.broker.bootstrap) if k == "episode_started"]
    assert [(e.episode_id, e.policy_version) for e in started] == [("g-sync-0", 1)]
    assert final.policy_version == 1
    status = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "harnessrl",
            "status",
            "--json",
            "--bootstrap",
            stack.broker.bootstrap,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    summary = json.loads(status.stdout)
    assert summary["groups"] == {"submitted": 1, "complete": 1, "in_progress": 0}
    assert summary["episodes"]["final"] == {"succeeded": 1}
    assert summary["by_policy_version"] == {"1": {"succeeded": 1}}
    assert summary["policy"]["latest_announced"] == 1
