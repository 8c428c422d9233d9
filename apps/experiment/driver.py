"""One experiment: evaluate the base policy, train for a fixed budget, evaluate again.

Everything goes through a running stack (started here with `harnessrl up`, or one already
running, found by its stack file) and through its topics, as any client would: val tasks
are submitted as MODE_VAL groups and measured by their rewards; train tasks are submitted
a few groups ahead of the controller until the trainer has taken `steps` steps (its
`max_steps`, so the budget is the trainer's own); the second evaluation waits until every
engine serves the last version. The report and the figures come from the topics and from
the services' /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from harnessrl.apps.experiment.ledger import TRAIN, VAL_AFTER, VAL_BEFORE, RunLedger
from harnessrl.apps.experiment.scrape import scrape
from harnessrl.apps.experiment.topics import task_bus
from harnessrl.apps.up.attach import RunningStack, stack_for_run
from harnessrl.command import Progress
from harnessrl.logs import get_logger
from harnessrl.tasks import TaskLine

log = get_logger(__name__)


class ExperimentError(RuntimeError):
    """The experiment could not run to its end; the message says where and why."""


@dataclass(frozen=True, slots=True)
class ExperimentOptions:
    run_dir: Path
    train: list[TaskLine]
    val: list[TaskLine]
    steps: int
    config: Path | None = None
    """`harnessrl up` config: start a stack for this run (in run_dir/stack)."""
    stack_file: Path | None = None
    """Or: the stack file of a running `harnessrl up`."""
    group_size: int | None = None
    """Episodes per train task (default: the task file's, else the controller's)."""
    val_group_size: int = 1
    backlog: int = 2
    """Train groups submitted ahead of the ones finished."""
    max_train_minutes: float = 30.0
    phase_timeout_s: float = 900.0
    ready_timeout_s: float = 300.0


async def run_experiment(options: ExperimentOptions, progress: IO[str]) -> dict[str, Any]:
    """Run it; returns the metrics the report is drawn from (see report.write_report)."""
    started = time.time()
    stack_cm = stack_for_run(
        options.run_dir,
        config=options.config,
        stack_file=options.stack_file,
        progress=progress,
        error=ExperimentError,
        env={
            "HARNESSRL_TRAINER__MAX_STEPS": str(options.steps),
            "HARNESSRL_TRAINER__AT_MAX_STEPS": "serve",  # the engine fetches the last version
        },
        ready_timeout_s=options.ready_timeout_s,
    )
    async with stack_cm as stack:
        return await _run(options, stack, progress, started)


async def _run(
    options: ExperimentOptions, stack: RunningStack, progress: IO[str], started: float
) -> dict[str, Any]:
    ledger = RunLedger()
    async with task_bus(stack.bootstrap, ledger) as (publish, changed):
        experiment = _Experiment(
            options, stack, ledger, publish=publish, changed=changed, progress=progress
        )
        metrics = await experiment.run()
    metrics.update(run_id=options.run_dir.name, config=str(options.config or ""))
    metrics["started_at"] = started
    metrics["summary"]["minutes"] = round((time.time() - started) / 60, 2)
    return metrics


class _Experiment:
    def __init__(
        self,
        options: ExperimentOptions,
        stack: RunningStack,
        ledger: RunLedger,
        *,
        publish: Any,
        changed: asyncio.Event,
        progress: IO[str],
    ) -> None:
        self.options, self.stack, self.ledger = options, stack, ledger
        self._publish, self._changed, self._progress = publish, changed, progress
        self._step_metrics: dict[int, dict[str, Any]] = {}
        self._trainer_scrape: dict[str, Any] = {}

    async def run(self) -> dict[str, Any]:
        await self._evaluate(VAL_BEFORE, "val (base)")
        train_started = time.time()
        await self._train()
        await self._wait_engines()
        await self._evaluate(VAL_AFTER, f"val (v{self.ledger.version})")
        return await self._metrics(train_started)

    async def _evaluate(self, phase: str, label: str) -> None:
        for task in self.options.val:
            await self._submit(task, phase, self.options.val_group_size)
        total = sum(g.size for g in self.ledger.phase(phase))
        deadline = time.monotonic() + self.options.phase_timeout_s
        bar = Progress(f"{label} episodes", total, self._progress)
        while self.ledger.outstanding(phase):
            if time.monotonic() > deadline:
                raise ExperimentError(f"{label}: not every episode was rewarded in time")
            await self._wait()
            done = self.ledger.episodes_done(phase)
            bar.update(len(done), f"success {_mean([e.reward or 0.0 for e in done]):.2f}")
        bar.close()

    async def _train(self) -> None:
        options, ledger = self.options, self.ledger
        tasks = itertools.cycle(options.train)
        deadline = time.monotonic() + options.max_train_minutes * 60
        bar = Progress("train steps", options.steps, self._progress)
        seen = 0
        while ledger.step < options.steps:
            if time.monotonic() > deadline:
                log.warning("training time budget spent", steps=ledger.step)
                break
            while ledger.outstanding(TRAIN) < options.backlog:
                task = next(tasks)
                await self._submit(task, TRAIN, options.group_size or task.group_size or 0)
            await self._wait()
            if len(ledger.steps) > seen:
                seen = len(ledger.steps)
                await self._scrape_step()
            episodes = ledger.episodes_done(TRAIN)
            recent = [e.reward or 0.0 for e in episodes[-64:]]
            bar.update(
                ledger.step,
                f"episodes {len(episodes)}  reward {_mean(recent):.2f} (last {len(recent)})"
                f"  policy v{ledger.version}",
            )
        bar.close()

    async def _wait_engines(self) -> None:
        deadline = time.monotonic() + self.options.phase_timeout_s
        while not self.ledger.engines_serve(self.ledger.version):
            if time.monotonic() > deadline:
                raise ExperimentError(f"engines did not load version {self.ledger.version}")
            await self._wait()

    async def _submit(self, task: TaskLine, phase: str, size: int) -> None:
        from harnessrl.tasks import new_group_id, to_event

        if phase != TRAIN:
            task = task.model_copy(update={"split": "val"})
        group_id = new_group_id()
        event = to_event(task.model_copy(update={"group_size": size or None}), group_id)
        self.ledger.submitted(group_id, task.task_id, phase, event.group_size or size or 1)
        await self._publish(event)

    async def _wait(self) -> None:
        failure = self.stack.failure()
        if failure is not None:
            raise ExperimentError(failure)
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), 1.0)

    async def _scrape_step(self) -> None:
        """The trainer's gauges describe its last step: read them as soon as it is seen."""
        step = self.ledger.steps[-1]
        try:
            scraped = await scrape(self.stack.urls["trainer"])
        except OSError as err:
            log.warning("trainer metrics unreadable", error=repr(err))
            return
        self._trainer_scrape = scraped
        self._step_metrics[step.step] = scraped["step"]

    async def _metrics(self, train_started: float) -> dict[str, Any]:
        ledger = self.ledger
        steps = [
            {
                "t": round(s.at - train_started, 3),
                "step": s.step,
                "version": s.version,
                **self._step_metrics.get(s.step, {}),
            }
            for s in ledger.steps
            if s.step > 0
        ]
        builder = await _scrape_or_empty(self.stack.urls.get("sample-builder"))
        trainer = self._trainer_scrape or {"staleness": {}, "dropped": {}}
        before, after = ledger.evaluation(VAL_BEFORE), ledger.evaluation(VAL_AFTER)
        episodes = len(ledger.episodes_done(TRAIN))
        return {
            "val_before": before,
            "val_after": after,
            "train": {
                "episodes": ledger.train_episodes(train_started),
                "calls": ledger.train_calls(train_started),
                "steps": steps,
                "staleness": {
                    "histogram": trainer["staleness"],
                    "dropped_stale": int(trainer["dropped"].get("stale", 0)),
                },
                "groups": builder.get("groups", {}),
                "merge": dict(ledger.merge),
            },
            "summary": {
                "val_before": before["success"],
                "val_after": after["success"],
                "episodes": episodes,
                "steps": ledger.step,
                # Bytes one weight sync moved per engine (the adapter alone under LoRA).
                "published_bytes": trainer.get("step", {}).get("published_bytes"),
            },
            "trace_hint": "",
            "sampled_episodes": ledger.sampled_episodes()[:50],
        }


async def _scrape_or_empty(url: str | None) -> dict[str, Any]:
    if url is None:
        return {}
    try:
        return await scrape(url)
    except OSError as err:
        log.warning("metrics unreadable", url=url, error=repr(err))
        return {}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
