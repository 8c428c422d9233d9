"""One chaos run: train through the real stack while services are killed and the broker is
frozen, then count what was lost or doubled.

The stack is the one `harnessrl up` plans (embedded broker, engine, gateway, reward, sample
builder, trainer, controller), each service a child process in its own process group. Train
groups are submitted a few ahead of the controller. Every `kill_every_s` seconds (with
jitter) one service, drawn from a shuffled round of all of them, is SIGKILLed with its
whole process group and started again with the same ports, config and instance name (so
its spill log and checkpoints are its own again); twice the broker is frozen with SIGSTOP
for `freeze_s`. The broker itself is never killed: the embedded one keeps its data in
memory only. When the time is up, no more groups are submitted, the groups in flight are
given `drain_timeout_s` to finish, the services are stopped in order (the trainer
checkpoints), and the books are reconciled from the topics and the trainer's step journal
(see reconcile.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from harnessrl.apps.chaos import KILLABLE
from harnessrl.apps.chaos.killable import ChaosStack
from harnessrl.apps.chaos.production_traffic import WINDOW_S, ProductionTraffic, session_env
from harnessrl.apps.chaos.reconcile import Books, reconcile
from harnessrl.apps.experiment.ledger import TRAIN, RunLedger
from harnessrl.apps.experiment.topics import task_bus
from harnessrl.command import Progress
from harnessrl.logs import get_logger
from harnessrl.tasks import TaskLine, new_group_id, to_event

log = get_logger(__name__)

BROKER = "broker"


class ChaosError(RuntimeError):
    """The run could not go on (a service did not come back, the stack broke)."""


@dataclass(frozen=True, slots=True)
class ChaosOptions:
    config: Path
    tasks: list[TaskLine]
    workdir: Path
    minutes: float = 5.0
    kill_every_s: float = 20.0
    freezes: int = 2
    freeze_s: float = 10.0
    seed: int = 0
    services: tuple[str, ...] = KILLABLE
    """What may be killed: drawn in shuffled rounds of these."""
    backlog: int = 3
    """Train groups kept submitted beyond those finished."""
    drain_timeout_s: float = 300.0
    ready_timeout_s: float = 180.0
    env: dict[str, str] = field(default_factory=dict)
    """Settings for every service (HARNESSRL_...), on top of the config file."""
    sessions_per_s: float = 0.5
    """Production sessions opened per second beside the episodes (0: none)."""


@dataclass(slots=True)
class Faults:
    kills: list[dict[str, Any]] = field(default_factory=list)
    freezes: list[dict[str, Any]] = field(default_factory=list)


CHAOS_ENV = {
    # Checkpoint often: a killed trainer then re-trains little (correctness never depends on it).
    "HARNESSRL_TRAINER__CHECKPOINT_EVERY": "2",
    # A harness outlives a gateway or engine restart: the SDK retries for longer than it.
    "HARNESSRL_CONTROLLER__HARNESS__TIMEOUT_S": "120",
}


async def run_chaos(options: ChaosOptions, progress: IO[str], log_file: IO[str]) -> dict[str, Any]:
    """Run it; returns the figures (faults injected and the reconciliation)."""
    from harnessrl.apps.up.plan import build_plan
    from harnessrl.telemetry.receiver import OtlpReceiver

    options.workdir.mkdir(parents=True, exist_ok=True)
    receiver = OtlpReceiver(options.workdir / "traces.jsonl", port=0)
    await receiver.start()
    started = time.monotonic()
    try:
        env = {**CHAOS_ENV, **options.env}
        if options.sessions_per_s > 0:
            env.update(session_env(options.workdir))
        with _environment(env):  # the plan reads the settings the services will
            plan = build_plan(options.config, options.workdir.resolve(), receiver.endpoint)
        plan = _with_env(plan, env)

        def emit(name: str, line: str) -> None:
            log_file.write(f"{name:>14} | {line}\n")

        stack = ChaosStack(plan, emit)
        progress.write(f"starting the stack (its log: {log_file.name})\n")
        progress.flush()
        books = Books()
        try:
            await stack.start(options.ready_timeout_s)
            traffic = _traffic(options, plan)
            faults = await _drive(options, stack, _group_size(options.config), traffic)
            progress.write("stopping the services; reconciling\n")
            progress.flush()
            await stack.stop([n for n in stack.names if n != BROKER])
            await _read_topics(plan.bootstrap, books)
            _read_progress(options.workdir / "episodes", books)
            if traffic is not None:
                books.sessions_told(traffic.sessions)
        finally:
            await stack.stop()
        from harnessrl.services.trainer import journal

        records = journal.read(options.workdir / "trainer" / journal.JOURNAL)
        figures = reconcile(books, records)
    finally:
        await receiver.stop()
    by_service: dict[str, int] = {}
    for kill in faults.kills:
        by_service[kill["service"]] = by_service.get(kill["service"], 0) + 1
    return {
        "kills": len(faults.kills),
        "freezes": len(faults.freezes),
        "kills_by_service": by_service,
        "minutes": round((time.monotonic() - started) / 60, 2),
        **figures,
        "faults": faults.kills + faults.freezes,
    }


def _group_size(config: Path) -> int:
    from harnessrl.config import load_config
    from harnessrl.services.controller.config import ControllerConfig

    return load_config(ControllerConfig, config).controller.group_size


def _with_env(plan: Any, env: dict[str, str]) -> Any:
    import dataclasses

    children = tuple(dataclasses.replace(spec, env={**spec.env, **env}) for spec in plan.children)
    return dataclasses.replace(plan, children=children)


def _traffic(options: ChaosOptions, plan: Any) -> ProductionTraffic | None:
    if options.sessions_per_s <= 0:
        return None
    if plan.feedback_url is None:
        raise ChaosError("production sessions: the stack serves no feedback API")
    return ProductionTraffic(
        plan.gateway.url, plan.feedback_url, rate=options.sessions_per_s, seed=options.seed
    )


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


async def _drive(
    options: ChaosOptions,
    stack: ChaosStack,
    group_size: int,
    traffic: ProductionTraffic | None = None,
) -> Faults:
    """Submit, inject faults until the time is up, drain. Returns the faults injected."""
    ledger = RunLedger()
    faults = Faults()
    async with task_bus(stack.plan.bootstrap, ledger) as (publish, changed):
        tasks = itertools.cycle(options.tasks)
        deadline = time.monotonic() + options.minutes * 60
        injector = asyncio.create_task(_inject(options, stack, faults, deadline), name="faults")
        sessions = asyncio.create_task(traffic.run()) if traffic is not None else None
        bar = Progress("chaos", int(options.minutes * 60))
        run_started = time.monotonic()
        try:
            while time.monotonic() < deadline:
                _check(stack, injector)
                while ledger.outstanding(TRAIN) < options.backlog:
                    await _submit(next(tasks), group_size, ledger, publish)
                await _wait(changed)
                bar.update(int(time.monotonic() - run_started), _note(ledger, faults))
            await injector
            bar.close()
            if traffic is not None and sessions is not None:
                traffic.stop()  # their feedback goes on; their windows end in the drain
                await sessions
                await _settle_sessions(stack, WINDOW_S + 10.0)
            drain = Progress("draining groups", len(ledger.phase(TRAIN)))
            drain_deadline = time.monotonic() + options.drain_timeout_s
            while ledger.outstanding(TRAIN) and time.monotonic() < drain_deadline:
                _check(stack, None)
                await _wait(changed)
                done = len(ledger.phase(TRAIN)) - ledger.outstanding(TRAIN)
                drain.update(done, _note(ledger, faults))
            drain.close()
        finally:
            injector.cancel()
            if sessions is not None:
                sessions.cancel()
            await asyncio.gather(
                injector, *([sessions] if sessions else []), return_exceptions=True
            )
    return faults


async def _settle_sessions(stack: ChaosStack, seconds: float) -> None:
    """Let the last sessions' feedback windows end and their rewards be built."""
    drain = Progress("feedback windows", int(seconds))
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        _check(stack, None)
        drain.update(int(elapsed), "sessions awaiting their reward")
        await asyncio.sleep(1.0)
    drain.close()


async def _inject(
    options: ChaosOptions, stack: ChaosStack, faults: Faults, deadline: float
) -> None:
    """Kills every ~kill_every_s, freezes at evenly spaced moments, until `deadline`."""
    rng = random.Random(options.seed)
    start = time.monotonic()
    span = deadline - start
    freeze_at = [start + span * (i + 1) / (options.freezes + 1) for i in range(options.freezes)]
    order: list[str] = []
    next_kill = start + options.kill_every_s / 2
    while True:
        now = time.monotonic()
        if freeze_at and freeze_at[0] <= now:
            freeze_at.pop(0)
            faults.freezes.append({"t": round(now - start, 1), "seconds": options.freeze_s})
            log.info("freezing the broker", seconds=options.freeze_s)
            await stack.freeze(BROKER, options.freeze_s)
            continue
        if next_kill <= now:
            if not order:
                order = list(options.services)
                rng.shuffle(order)
            name = order.pop()
            log.info("killing", service=name)
            down = await stack.kill_and_restart(name, options.ready_timeout_s)
            faults.kills.append({"t": round(now - start, 1), "service": name, "down_s": down})
            jitter = rng.uniform(-0.25, 0.25) * options.kill_every_s
            next_kill = max(time.monotonic(), next_kill + options.kill_every_s + jitter)
            continue
        upcoming = min([next_kill, *freeze_at])
        if upcoming >= deadline:
            return
        await asyncio.sleep(max(0.0, upcoming - time.monotonic()))


def _check(stack: ChaosStack, injector: asyncio.Task[None] | None) -> None:
    if injector is not None and injector.done() and not injector.cancelled():
        error = injector.exception()
        if error is not None:
            raise ChaosError(f"fault injection failed: {error}") from error
    failure = stack.failure()
    if failure is not None:
        raise ChaosError(failure)


async def _submit(task: TaskLine, group_size: int, ledger: RunLedger, publish: Any) -> None:
    group_id = new_group_id()
    sized = task.model_copy(update={"group_size": task.group_size or group_size})
    event = to_event(sized, group_id)
    ledger.submitted(group_id, task.task_id, TRAIN, event.group_size)
    await publish(event)


async def _wait(changed: asyncio.Event) -> None:
    changed.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), 1.0)


def _note(ledger: RunLedger, faults: Faults) -> str:
    return (
        f"kills {len(faults.kills)}  freezes {len(faults.freezes)}  "
        f"episodes {len(ledger.episodes_done(TRAIN))}  policy v{ledger.version}"
    )


async def _read_topics(bootstrap: str, books: Books) -> None:
    from harnessrl import events
    from harnessrl.bus.snapshot import read_to_end
    from harnessrl.config import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    topics = (events.TASKS, events.EPISODES, events.CALLS, events.REWARDS, events.SAMPLES)
    for topic in (*topics, events.POLICY):
        async for kind, event, _ in read_to_end(kafka, topic, client_id="harnessrl-chaos"):
            books.apply(kind, event)


def _read_progress(workdir: Path, books: Books) -> None:
    """What each started attempt's harness recorded as answered, from its run directory."""
    import json

    from harnessrl.services.controller.local import run_dir

    for episode_id, attempts in books.started.items():
        for attempt in attempts:
            path = run_dir(workdir, episode_id, attempt) / "progress.json"
            try:
                calls = json.loads(path.read_text()).get("calls")
            except (OSError, ValueError, AttributeError):
                continue  # killed before its first answer, or not the calculator harness
            if isinstance(calls, int) and calls >= 0:
                books.progress[(episode_id, attempt)] = calls
