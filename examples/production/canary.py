"""The canary demo: every new version earns its traffic; a harmful one is rolled back, a
helpful one promoted, and killing the gateway and the engine mid-canary changes nothing.

The stack of examples/production/canary.yaml (the help desk of the production demo, LoRA
versions, `production.canary` on) runs with the help desk app (app.py) and simulated users.
Users ask, the desk's ticket system reports whether each problem was solved (`resolved`:
held out, it judges the canary and never trains), and most users press a thumb (what
trains). Two phases:

1. **Broken widget.** The desk's thumbs buttons are swapped: a user who means "up" sends
   "down". The trainer learns from an inverted reward; its version `candidate_after_versions`
   past stable becomes the candidate, serves half of the new conversations, solves fewer of
   them, and is rolled back by the judge. The trainer rewinds to stable.
2. **Fixed widget.** Thumbs are honest again; the trainer's next candidate is better and is
   promoted. While it is judged, the gateway and then the engine are SIGKILLed and started
   again.

Then it checks the topics: every conversation's calls were all served by the version it
was assigned at its first call (none switched), and reports each decision with its
evidence, the sessions each candidate served and the token books (captured = trained +
dropped by reason, `trainer:rolled_back` among them, + pending + undecided), in
RUN_DIR/canary.json (the last line
printed is its summary). A progress line every 15 seconds.

    python -m examples.production.canary --run-dir runs/canary
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import httpx
from examples.calculator.tasks import problems
from examples.production.demo import DemoError, help_desk, measure
from examples.production.report import books
from examples.production.users import Outcome, ask

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "production" / "canary.yaml"
PROGRESS_S = 15.0


@dataclass(slots=True)
class Widget:
    """The desk's thumbs buttons: swapped (a bug) or not. Users read it at each press."""

    swapped: bool = True


@dataclass(slots=True)
class Traffic:
    """What the users saw."""

    outcomes: list[Outcome] = field(default_factory=list)
    failed_asks: int = 0
    signals: Counter[str] = field(default_factory=Counter)
    """Feedback answers by signal and status ("thumbs 202", "resolved 409")."""


@dataclass(frozen=True, slots=True)
class Options:
    run_dir: Path
    users: int = 8
    phase_minutes: float = 15.0
    """Longest wait for each candidate and for each decision."""
    seed: int = 0


async def run_users(
    app_url: str, options: Options, widget: Widget, traffic: Traffic, stop: asyncio.Event
) -> None:
    """Users ask one problem after another until `stop`; each answer's `resolved` is sent
    at once (the ticket closes), a thumb (85% of the time) after a short delay."""
    seed = options.seed
    pool = problems("train", 3000, seed=seed + 1)
    pending: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(base_url=app_url, timeout=180.0) as client:

        async def signal(path: str, body: dict[str, Any], name: str, delay: float) -> None:
            await asyncio.sleep(delay)
            with contextlib.suppress(httpx.HTTPError):
                response = await client.post(path, json=body)
                traffic.signals[f"{name} {response.status_code}"] += 1

        def later(coroutine: Any) -> None:
            task = asyncio.create_task(coroutine)
            pending.add(task)
            task.add_done_callback(pending.discard)

        async def user(number: int) -> None:
            rng = random.Random(f"canary-user/{seed}/{number}")
            while not stop.is_set():
                try:
                    outcome = await ask(client, f"user{number}", rng.choice(pool))
                except httpx.HTTPError:
                    traffic.failed_asks += 1  # the desk answered 5xx: the user asks again
                    await asyncio.sleep(1.0)
                    continue
                traffic.outcomes.append(outcome)
                conversation = outcome.conversation
                solved = {"conversation": conversation, "resolved": outcome.correct}
                later(signal("/resolved", solved, "resolved", 0.0))
                if rng.random() < 0.85:
                    up = outcome.correct != widget.swapped
                    delay = rng.expovariate(1 / 2.0)
                    later(
                        signal("/thumbs", {"conversation": conversation, "up": up}, "thumbs", delay)
                    )
                await asyncio.sleep(rng.expovariate(1 / 0.2))

        await asyncio.gather(*(user(n) for n in range(options.users)))
        if pending:
            await asyncio.wait(set(pending), timeout=30)


class PolicyWatch:
    """hrl.policy, read again every second and folded (harnessrl.rollout)."""

    def __init__(self, bootstrap: str) -> None:
        self._bootstrap = bootstrap
        self.decisions: list[Any] = []
        self.state: Any = None
        self.changed = asyncio.Event()

    async def run(self) -> None:
        from harnessrl import events
        from harnessrl.bus.snapshot import read_to_end
        from harnessrl.config import KafkaSettings
        from harnessrl.rollout import RolloutState
        from harnessrl.v1 import events_pb2 as pb

        kafka = KafkaSettings(bootstrap_servers=self._bootstrap)
        while True:
            fold, decisions = RolloutState(), []
            async for _, event, _ in read_to_end(kafka, events.POLICY, client_id="canary-demo"):
                if isinstance(event, pb.PolicyVersion):
                    fold.announced(event)
                elif (
                    isinstance(event, pb.RolloutDecision)
                    and fold.decided(event) is None
                    and event.decision_id not in {d.decision_id for d in decisions}
                ):
                    decisions.append(event)
            if len(decisions) != len(self.decisions):
                self.changed.set()
            self.decisions, self.state = decisions, fold.state
            await asyncio.sleep(1.0)

    async def until(self, found: Callable[[Any], bool], timeout_s: float, what: str) -> Any:
        """The first applied decision `found` accepts, waiting at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            for decision in self.decisions:
                if found(decision):
                    return decision
            left = deadline - time.monotonic()
            if left <= 0:
                raise DemoError(f"no {what} within {timeout_s:g} s")
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 5.0))


def _action(decision: Any) -> str:
    from harnessrl.rollout import ACTION_NAMES

    return ACTION_NAMES.get(decision.action, "?")


async def run_canary(options: Options, progress: IO[str]) -> dict[str, Any]:
    """Run both phases; returns the report, also written to RUN_DIR/canary.json."""
    from harnessrl.apps.chaos.killable import ChaosStack
    from harnessrl.apps.up.plan import build_plan
    from harnessrl.telemetry.receiver import OtlpReceiver

    run_dir = options.run_dir
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    receiver = OtlpReceiver(run_dir / "traces.jsonl", port=0)
    await receiver.start()
    started = time.monotonic()
    log_file = (run_dir / "stack.log").open("a")
    try:
        plan = build_plan(CONFIG, run_dir.absolute(), receiver.endpoint)
        stack = ChaosStack(plan, lambda name, line: log_file.write(f"{name:>14} | {line}\n"))
        progress.write(f"starting the stack (its log: {log_file.name})\n")
        progress.flush()
        try:
            await stack.start(180.0)
            report = await _phases(stack, plan, options, progress)
            urls = {c.name: c.health_url.removesuffix("/healthz") for c in plan.children}
            journal = run_dir / "trainer" / "steps.jsonl"
            report["books"] = books(await measure(plan.bootstrap, urls, journal))
            await stack.stop([n for n in stack.names if n != "broker"])
            report.update(await _measure(plan.bootstrap, report))
        finally:
            await stack.stop()
    finally:
        log_file.close()
        await receiver.stop()
    report["minutes"] = round((time.monotonic() - started) / 60, 1)
    (run_dir / "canary.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


async def _phases(stack: Any, plan: Any, options: Options, progress: IO[str]) -> dict[str, Any]:
    widget, traffic, stop = Widget(swapped=True), Traffic(), asyncio.Event()
    watch = PolicyWatch(plan.bootstrap)
    watcher = asyncio.create_task(watch.run())
    timeout_s = options.phase_minutes * 60
    report: dict[str, Any] = {}
    app_log = options.run_dir / "app.log"
    async with help_desk(plan.gateway.url, plan.feedback_url, app_log) as app_url:
        crowd = asyncio.create_task(run_users(app_url, options, widget, traffic, stop))
        ticker = asyncio.create_task(_progress(traffic, widget, watch, progress))
        try:
            progress.write("phase 1: the thumbs widget is broken (users' thumbs are inverted)\n")
            harmful = await watch.until(lambda d: _action(d) == "start", timeout_s, "candidate")
            progress.write(
                f"  candidate v{harmful.version} started against stable v{harmful.stable}\n"
            )
            rollback = await watch.until(
                lambda d: d.version == harmful.version and _action(d) in ("rollback", "promote"),
                timeout_s, f"decision on v{harmful.version}")  # fmt: skip
            report["harmful"] = _decision(harmful, rollback)
            progress.write(f"  v{harmful.version}: {_action(rollback)} ({rollback.reason})\n")
            widget.swapped = False
            progress.write("phase 2: the widget is fixed (honest thumbs)\n")
            helpful = await watch.until(
                lambda d: _action(d) == "start" and d.version > harmful.version,
                timeout_s, "second candidate")  # fmt: skip
            progress.write(
                f"  candidate v{helpful.version} started; killing the gateway, then the engine\n"
            )
            kills = []
            for name in ("gateway", "inference"):
                await asyncio.sleep(15.0)
                down = await stack.kill_and_restart(name, 180.0)
                kills.append({"service": name, "down_s": round(down, 1)})
                progress.write(f"  {name} killed and back after {down:.1f} s\n")
            decision = await watch.until(
                lambda d: d.version == helpful.version and _action(d) in ("rollback", "promote"),
                timeout_s, f"decision on v{helpful.version}")  # fmt: skip
            report["helpful"] = _decision(helpful, decision)
            report["kills"] = kills
            progress.write(f"  v{helpful.version}: {_action(decision)} ({decision.reason})\n")
        finally:
            stop.set()
            ticker.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(crowd, 120)
            watcher.cancel()
    report["conversations"] = len(traffic.outcomes)
    report["failed_asks"] = traffic.failed_asks
    report["signals"] = dict(sorted(traffic.signals.items()))
    report["decisions"] = [_described(d) for d in watch.decisions]
    return report


def _decision(start: Any, end: Any) -> dict[str, Any]:
    evidence = json.loads(end.evidence_json) if end.evidence_json else {}
    return {
        "version": start.version,
        "stable": start.stable,
        "outcome": _action(end),
        "reason": end.reason,
        "actor": end.actor,
        "sessions_at_decision": evidence.get("sessions", {}),
        "rewarded_at_decision": evidence.get("rewarded", {}),
        "means": evidence.get("means", {}),
        "interval": evidence.get("reward", {}),
    }


def _described(decision: Any) -> dict[str, Any]:
    return {
        "action": _action(decision),
        "version": decision.version,
        "stable": decision.stable,
        "actor": decision.actor,
        "reason": decision.reason,
    }


async def _progress(traffic: Traffic, widget: Widget, watch: PolicyWatch, out: IO[str]) -> None:
    begun = time.time()
    while True:
        await asyncio.sleep(PROGRESS_S)
        now = time.time()
        recent = [o for o in traffic.outcomes if o.answered_at > now - 60]
        rate = sum(o.correct for o in recent) / len(recent) if recent else 0.0
        state = watch.state
        where = (
            ""
            if state is None
            else f"stable v{state.stable} candidate {state.candidate} newest {state.newest}"
        )
        out.write(
            f"  {(now - begun) / 60:4.1f} min  conversations {len(traffic.outcomes):5d}  "
            f"solved (last minute) {rate:.2f}  widget {'swapped' if widget.swapped else 'fixed'}  "
            f"{where}\n"
        )
        out.flush()


async def _measure(bootstrap: str, report: dict[str, Any]) -> dict[str, Any]:
    """From the topics: each candidate's sessions by arm, and whether any session's calls
    were served by another version than the one it was assigned."""
    from harnessrl import events
    from harnessrl.bus.snapshot import read_to_end
    from harnessrl.config import KafkaSettings
    from harnessrl.v1 import events_pb2 as pb

    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    assigned: dict[str, tuple[str, int, int]] = {}
    async for _, event, _ in read_to_end(kafka, events.EPISODES, client_id="canary-demo"):
        if isinstance(event, pb.EpisodeStarted) and event.HasField("session"):
            info = event.session
            assigned.setdefault(event.group_id, (info.arm, info.policy_version, info.canary))
    served: dict[str, set[int]] = {}
    async for _, event, _ in read_to_end(kafka, events.CALLS, client_id="canary-demo"):
        if isinstance(event, pb.ModelCall) and event.group_id in assigned:
            served.setdefault(event.group_id, set()).add(event.policy_version)
    switched = sorted(
        group for group, versions in served.items() if versions != {assigned[group][1]}
    )
    by_candidate: dict[str, dict[str, int]] = {}
    for arm, _version, canary in assigned.values():
        if canary:
            arms = by_candidate.setdefault(f"v{canary}", {})
            arms[arm] = arms.get(arm, 0) + 1
    for key in ("harmful", "helpful"):
        if key in report:
            report[key]["sessions_served"] = by_candidate.get(f"v{report[key]['version']}", {})
    return {
        "sessions": len(assigned),
        "sessions_with_calls": len(served),
        "sessions_switched_version": len(switched),
        "switched_examples": switched[:5],
        "sessions_by_candidate": by_candidate,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8, help="users asking at once")
    parser.add_argument("--phase-minutes", type=float, default=15.0,
                        help="longest wait for each candidate and each decision")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    run_dir = args.run_dir or ROOT / "runs" / f"canary-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        report = asyncio.run(
            run_canary(Options(run_dir, args.users, args.phase_minutes, args.seed), sys.stderr)
        )
    except DemoError as err:
        sys.stderr.write(f"demo-canary: {err}\n")
        raise SystemExit(1) from None
    summary = {
        key: report.get(key)
        for key in (
            "harmful",
            "helpful",
            "kills",
            "sessions",
            "sessions_switched_version",
            "books",
            "minutes",
        )
    }
    sys.stdout.write(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
