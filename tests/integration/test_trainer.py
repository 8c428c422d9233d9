"""The trainer on the real broker with the real engine: its log-probs equal the engine's,
a step is served and loaded, a SIGKILLed trainer (two FSDP ranks) resumes on one process
without training anything twice or skipping anything (the sharded step itself:
test_trainer_sharded.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import yaml
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.runtime import Runtime
from harnessrl.services.trainer import journal
from harnessrl.services.trainer.checkpoint import Checkpoints
from harnessrl.services.trainer.config import TrainerConfig, TrainerSection
from harnessrl.services.trainer.policy import Policy
from harnessrl.services.trainer.service import TrainerService
from harnessrl.trust.loss import token_logprobs
from harnessrl.trust.packing import SampleArrays, normalization_weights, pack
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, events_on, eventually
from tests.integration.test_policy_follow import engine
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration
__all__ = ["engine"]  # fixture used here

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[11, 257, 400, 12, 90], [300, 301, 302, 303], [5, 6, 7, 8, 9, 10, 11]]


async def sampled(base_url: str, prompt: list[int], temperature: float, seed: int) -> pb.Sample:
    """A completion from the engine as the gateway records it, as a one-call Sample."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        answer = await client.post(
            "/v1/completions",
            json={
                "model": "tiny-model",
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": temperature,
                "seed": seed,
                "logprobs": 1,
                "return_token_ids": True,
            },
        )
    answer.raise_for_status()
    choice = answer.json()["choices"][0]
    completion = choice["token_ids"]
    logprobs = choice["logprobs"]["token_logprobs"]
    return pb.Sample(
        sample_id=f"s{seed}/1/0",
        episode_id=f"s{seed}",
        attempt=1,
        token_ids=prompt + completion,
        loss_mask=[False] * len(prompt) + [True] * len(completion),
        behavior_logprobs=[0.0] * len(prompt) + logprobs,
        temperature=temperature,
        policy_version_min=int(answer.headers["x-policy-version"]),
        policy_version_max=int(answer.headers["x-policy-version"]),
    )


async def test_recomputed_logprobs_equal_the_engines_behaviour_logprobs(
    engine: tuple[str, Any],
) -> None:
    base_url, _ = engine
    samples = [
        SampleArrays.from_proto(await sampled(base_url, prompt, temperature, seed))
        for seed, (prompt, temperature) in enumerate((p, t) for p in PROMPTS for t in (1.0, 0.7))
    ]
    policy = Policy.load(TrainerSection(model=TINY, device="cpu"))
    weights = normalization_weights(samples, "token_mean", constant_tokens=1)
    diffs = []
    with torch.no_grad():
        for batch in pack(samples, weights, micro_batch_tokens=64):
            logp = token_logprobs(policy.model, batch)  # [B, T]
            diffs.append((logp - batch.behavior)[batch.loss_mask].abs())
    diff = torch.cat(diffs)
    print(f"trainer vs engine log-probs: mean |diff| {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.numel() == sum(int(s.loss_mask.sum()) for s in samples) > 0
    assert float(diff.mean()) < 1e-4 and float(diff.max()) < 1e-3  # ratio 1 on a first pass


def trained_ids(tmp_path: Path) -> set[str]:
    """The sample ids the `trainer` fixture's steps trained on, from its step journal."""
    records = journal.read(tmp_path / "checkpoints" / journal.JOURNAL)
    return {s for step in journal.lineage(records) for s in step.samples}


@asynccontextmanager
async def trainer(
    broker: EmbeddedBroker,
    tmp_path: Path,
    tracer_provider: TracerProvider | None = None,
    **section: Any,
) -> AsyncIterator[TrainerService]:
    config = TrainerConfig(
        instance="trainer-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "trainer-spill"),
        trainer=TrainerSection(
            **{
                "port": 0,
                "model": TINY,
                "device": "cpu",
                "checkpoint_dir": tmp_path / "checkpoints",
                "weightsync": {"port": 0},
            }
            | section
        ),
    )
    service = TrainerService(
        config,
        Runtime("trainer", "trainer-0", CollectorRegistry(), tracer_provider or TracerProvider()),
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield service
    finally:
        await service.stop()
        await task


async def publish(broker: EmbeddedBroker, tmp_path: Path, *groups: pb.GroupSamples) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "publish-spill"),
        name="sample-builder/test",
    )
    await producer.start()
    for group in groups:
        await producer.publish(group)
    await producer.stop()


async def policy_events(broker: EmbeddedBroker) -> list[tuple[str, Any]]:
    return await events_on(broker.bootstrap, events.POLICY)


def group_of(group_id: str, samples: list[pb.Sample], advantages: list[float]) -> pb.GroupSamples:
    group = pb.GroupSamples(group_id=group_id, task_id=group_id, estimator="grpo")
    for sample, advantage in zip(samples, advantages, strict=True):
        copy = group.samples.add()
        copy.CopyFrom(sample)
        copy.sample_id = f"{group_id}/{sample.sample_id}"
        copy.episode_id = f"{group_id}/{sample.episode_id}"
        copy.advantage = advantage
    return group


@pytest.mark.parametrize("schedule", ["async", "sync"])
async def test_a_step_is_served_and_the_engine_answers_with_the_new_version(
    broker: EmbeddedBroker, engine: tuple[str, Any], tmp_path: Path, schedule: str
) -> None:
    base_url, _ = engine
    good = await sampled(base_url, PROMPTS[0], 1.0, 1)
    bad = await sampled(base_url, PROMPTS[0], 1.0, 2)
    before = await sampled(base_url, PROMPTS[0], 1.0, 1)
    async with trainer(
        broker, tmp_path, batch_groups=1, lr=1e-2, checkpoint_every=1, schedule=schedule
    ) as service:
        await publish(broker, tmp_path, group_of("g1", [good, bad], [1.0, -1.0]))

        async def loaded() -> bool:
            return any(
                kind == "policy_loaded" and e.version == 1 and e.ok
                for kind, e in await policy_events(broker)
            )

        await eventually(loaded, timeout=60, interval=0.3)
        assert service.step == 1 and service.version == 1
    after = await sampled(base_url, PROMPTS[0], 1.0, 1)
    assert after.policy_version_min == 1  # the engine answers with the new weights
    # Same seed, new weights: the sampled reply (or its log-probs) moved.
    assert list(after.behavior_logprobs) != list(before.behavior_logprobs)
    policy = await policy_events(broker)
    announced = [e for kind, e in policy if kind == "policy_version"]
    assert [e.version for e in announced] == [0, 1]
    if schedule == "sync":  # pause, announce, the engine loads, resume: in that order
        order = [
            (kind, e.action if kind == "control_command" else e.version)
            for kind, e in policy
            if kind != "policy_version" or e.version == 1
        ]
        assert order == [
            ("control_command", pb.CONTROL_ACTION_PAUSE),
            ("policy_version", 1),
            ("policy_loaded", 1),
            ("control_command", pb.CONTROL_ACTION_RESUME),
        ]
    assert announced[1].checkpoint_uri.startswith("file://")
    state = Checkpoints(tmp_path / "checkpoints").latest()
    assert state is not None and state.name == "step-00000001"


def _trainer_config(tmp_path: Path, bootstrap: str, **trainer: Any) -> Path:
    path = tmp_path / "trainer.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "kafka": {"bootstrap_servers": bootstrap, "partitions": 3},
                "consumer": FAST_GROUP,
                "producer": {"spill_dir": str(tmp_path / "spill")},
                "telemetry": {"exporter": "none"},
                "trainer": {
                    "port": 0,
                    "model": str(TINY),
                    "device": "cpu",
                    "checkpoint_dir": str(tmp_path / "checkpoints"),
                    "weightsync": {"port": 0},
                    "batch_groups": 1,
                    "checkpoint_every": 2,
                    "lr": 1e-3,
                    "max_staleness": 1000,  # this test is about crashes, not staleness
                }
                | trainer,
            }
        )
    )
    return path


def _six_groups() -> list[pb.GroupSamples]:
    """Six groups of two one-call samples each (random completions of PROMPTS[0])."""
    rng = np.random.default_rng(0)
    groups = []
    for g in range(6):
        samples = []
        for e in range(2):
            completion = rng.integers(20, 2000, 6).tolist()
            samples.append(
                pb.Sample(
                    sample_id=f"s{e}/1/0",
                    episode_id=f"s{e}",
                    token_ids=PROMPTS[0] + completion,
                    loss_mask=[False] * 5 + [True] * 6,
                    behavior_logprobs=[0.0] * 5 + [-7.0] * 6,
                    temperature=1.0,
                )
            )
        groups.append(group_of(f"g{g}", samples, [1.0, -1.0]))
    return groups


async def test_a_killed_trainer_resumes_without_training_a_sample_twice_or_skipping_one(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    groups = _six_groups()
    config = _trainer_config(tmp_path, broker.bootstrap)
    trainer = ["-m", "harnessrl.services.trainer", "--config", str(config)]
    command = [sys.executable, *trainer]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    # The first trainer is two FSDP ranks (each version all-gathered for publication, each
    # checkpoint sharded); the whole pod dies at once; one process resumes its checkpoint.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    log_path = tmp_path / "first.log"
    with log_path.open("wb") as log_file:
        first = subprocess.Popen(
            [*torchrun, "--master-port", str(_free_port()), *trainer],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        await publish(broker, tmp_path, *groups)

        async def three_steps() -> bool:
            versions = [e.version for k, e in await policy_events(broker) if k == "policy_version"]
            return max(versions, default=0) >= 3

        await eventually(three_steps, timeout=120, interval=0.2)
    except BaseException:
        print(log_path.read_text()[-5000:])
        raise
    finally:
        _kill_tree(first.pid)
        first.wait(30)
    assert '"world":2' in log_path.read_text()  # it did run sharded
    second_log = tmp_path / "second.log"
    with second_log.open("wb") as log_file:
        second = subprocess.Popen(
            [*command, "--max-steps", "6"], env=env, stdout=subprocess.DEVNULL, stderr=log_file
        )
        try:
            code = await asyncio.to_thread(second.wait, 150)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
            pytest.fail(f"the resumed trainer did not finish:\n{second_log.read_text()[-6000:]}")
    assert code == 0, second_log.read_text()[-3000:]
    checkpoints = Checkpoints(tmp_path / "checkpoints")
    latest = checkpoints.latest()
    assert latest is not None
    policy = Policy.load(TrainerSection(model=TINY, device="cpu"))
    state = checkpoints.load(latest, policy.load_tensors)
    every = {s.sample_id for g in groups for s in g.samples}
    assert state.step == 6  # six groups, one step each: nothing trained twice
    assert set(state.ledger.trained) == every  # and nothing skipped (all within max_staleness)
    # The step journal says the same: the lineage of these weights is six steps, every
    # sample in exactly one of them (steps lost with the kill are not part of it).
    records = journal.read(tmp_path / "checkpoints" / journal.JOURNAL)
    steps = journal.lineage(records)
    assert [r.step for r in steps] == [1, 2, 3, 4, 5, 6]
    assert sorted(s for r in steps for s in r.samples) == sorted(every)
    assert journal.trained_twice(records) == []
    # Versions never go back, and a version lost with the crash is never reused for other
    # weights (a checkpoint's own version may be announced again: same step, same weights).
    announced = [
        (e.version, e.step) for k, e in await policy_events(broker) if k == "policy_version"
    ]
    assert [v for v, _ in announced] == sorted(v for v, _ in announced)
    assert len(set(announced)) == len({v for v, _ in announced})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it at once, as when a pod dies (torchrun's
    workers are not in its process group)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    doomed, todo = [], [pid]
    while todo:
        doomed.append(todo.pop())
        todo += children.get(doomed[-1], [])
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
