"""`harnessrl policy status|promote|rollback|pin|unpin`: the canary rollout as hrl.policy tells
it, and an operator's override of it.

Every command reads hrl.policy to its end and folds it with harnessrl.rollout, as every
service does. `status` prints the fold (stable, candidate and its share, pinned, current,
rolled back), what each engine serves (its newest PolicyLoaded) and the last decisions with
their evidence. The others build one RolloutDecision (actor "operator:<name>"), check it with
`rollout.refusal` against the state just read, and publish it only when nothing refuses it:
a refused one is printed as "harnessrl policy <action>: <reason>" with exit code 2 and never
reaches the topic. A published one is read back from the topic until the fold has applied
or refused it where it landed (another decision may have landed first: exit code 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from harnessrl.command import CliError, add_kafka_options, load

if TYPE_CHECKING:  # the CLI imports pydantic (harnessrl.rollout) only when a command runs
    from harnessrl.config import KafkaSettings, ServiceConfig
    from harnessrl.rollout import Rollout, RolloutState
    from harnessrl.v1 import events_pb2 as pb

T = TypeVar("T")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "policy",
        help="the canary rollout: show it, or promote, roll back, pin or unpin by hand",
        description="Read hrl.policy to its end and show the canary rollout (stable and "
        "candidate versions, what each engine serves, the last decisions and their "
        "evidence), or override the automatic judge: each action publishes one "
        "RolloutDecision with actor operator:<name>, after checking it applies to the state "
        "just read (a refused one is printed with the reason, exit code 2, and not "
        "published), then waits until the topic shows it applied.",
    )
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    status = actions.add_parser("status", help="show the rollout's state and last decisions")
    status.add_argument(
        "--decisions", type=int, default=10, metavar="N", help="decisions shown (10)"
    )
    _common(status)
    status.set_defaults(run=run_status)
    helps = {
        "promote": "make VERSION stable (default: the pending candidate)",
        "rollback": "roll VERSION back (default: the candidate; with none pending, stable, "
        "which returns to the stable version before it)",
        "pin": "make VERSION stable and start no candidate until unpin",
        "unpin": "let candidates start again",
    }
    for name, text in helps.items():
        action = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        if name == "pin":
            action.add_argument("version", metavar="VERSION", help="the policy version")
        elif name != "unpin":
            action.add_argument("version", metavar="VERSION", nargs="?", help="policy version")
        action.add_argument(
            "--by", metavar="NAME", help="the operator's name in the decision (default $USER)"
        )
        action.add_argument("--reason", default="", help="why, recorded with the decision")
        action.add_argument(
            "--timeout",
            type=float,
            default=30.0,
            metavar="S",
            help="seconds to wait for the decision to be published and read back (30)",
        )
        _common(action)
        action.set_defaults(run=run_decide, action=name)


def _common(parser: argparse.ArgumentParser) -> None:
    add_kafka_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass(slots=True)
class EngineServing:
    """What one inference replica serves, from its newest PolicyLoaded."""

    serving: list[tuple[int, str]] = field(default_factory=list)
    """(version, model name a request carries for it) of its last successful load."""
    failed: str = ""
    """Its newest load, when that one failed: the version and the error."""


@dataclass(slots=True)
class RolloutBook:
    """hrl.policy folded: the rollout, each engine's versions, every decision's outcome."""

    fold: RolloutState
    engines: dict[str, EngineServing] = field(default_factory=dict)
    decisions: list[tuple[pb.RolloutDecision, str | None]] = field(default_factory=list)
    """Each decision, in topic order, with its refusal (None: applied)."""

    def add(self, kind: str, event: Any) -> None:
        if kind == "policy_version":
            self.fold.announced(event)
        elif kind == "rollout_decision":
            seen, refused = self.fold.outcome(event.decision_id)
            if seen and refused is None:
                return  # a copy of an applied decision (delivered at least once)
            self.decisions.append((event, self.fold.decided(event)))
        elif kind == "policy_loaded":
            engine = self.engines.setdefault(event.engine, EngineServing())
            if not event.ok:
                engine.failed = f"v{event.version}: {event.error or 'failed'}"
                return
            engine.failed = ""
            engine.serving = [(int(s.version), s.model) for s in event.serving] or [
                (int(event.version), event.served_model)
            ]


async def read_book(kafka: KafkaSettings) -> RolloutBook:
    """hrl.policy as it is now, folded."""
    from harnessrl import events
    from harnessrl.bus.snapshot import read_to_end
    from harnessrl.rollout import RolloutState

    book = RolloutBook(RolloutState())
    async for kind, event, _ in read_to_end(kafka, events.POLICY, client_id="harnessrl-policy"):
        book.add(kind, event)
    return book


def evidence(text: str) -> dict[str, Any] | None:
    """The evidence JSON of a decision as an object (None: there is none or it is unreadable)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def evidence_line(decision: pb.RolloutDecision) -> str:
    """The judge's evidence in a line: sessions and mean reward per arm, the interval on
    candidate minus stable against its thresholds, the guard that decided."""
    found = evidence(decision.evidence_json)
    if found is None:
        return "evidence unreadable" if decision.evidence_json else ""
    parts = []
    sessions, rewarded, means = (found.get(k) for k in ("sessions", "rewarded", "means"))
    if isinstance(sessions, dict):
        text = f"sessions {_arms(sessions)}"
        if isinstance(rewarded, dict):
            text += f" (rewarded {_n(rewarded.get('stable'))} / {_n(rewarded.get('candidate'))})"
        parts.append(text)
    if isinstance(means, dict):
        parts.append(f"mean reward {_arms(means)}")
    reward = found.get("reward")
    if isinstance(reward, dict) and isinstance(reward.get("estimate"), int | float):
        parts.append(f"candidate - stable {_interval(reward)}")  # none while an arm has none
    if "promote_above" in found or "rollback_below" in found:
        parts.append(
            f"promote above {_n(found.get('promote_above'))}, "
            f"roll back below {_n(found.get('rollback_below'))}"
        )
    guards = found.get("guards")
    if isinstance(guards, dict) and isinstance(guards.get(decision.reason), dict):
        parts.append(f"{decision.reason} rate diff {_interval(guards[decision.reason])}")
    known = {"sessions", "rewarded", "means", "reward", "promote_above", "rollback_below"}
    known |= {"guards", "action", "reason"}
    parts += [f"{k} {_n(v)}" for k, v in found.items() if k not in known and _scalar(v)]
    return "; ".join(parts)


def _arms(value: dict[str, Any]) -> str:
    return f"stable {_n(value.get('stable'))} / candidate {_n(value.get('candidate'))}"


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _n(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "-" if value is None else str(value)
    return "-" if isinstance(value, float) and not math.isfinite(value) else f"{value:.4g}"


def _v(version: int | None) -> str:
    return "none" if version is None else f"v{version}"


def _interval(value: dict[str, Any]) -> str:
    low, high = value.get("lower"), value.get("upper")
    return f"{_n(value.get('estimate'))} in [{_n(low)}, {_n(high)}]"


def _stamp(decision: pb.RolloutDecision) -> str | None:
    nanos: int = decision.decided_at.ToNanoseconds()
    if not nanos:
        return None
    return datetime.fromtimestamp(nanos / 1e9, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_json(book: RolloutBook, last: int) -> dict[str, Any]:
    """The state, the engines and the `last` decisions, as JSON-ready values."""
    from harnessrl.rollout import ACTION_NAMES, describe

    return {
        "state": dict(describe(book.fold.state)),
        "engines": {
            name: {
                "serving": [{"version": v, "model": m} for v, m in engine.serving],
                "failed": engine.failed or None,
            }
            for name, engine in sorted(book.engines.items())
        },
        "decisions": [
            {
                "decision_id": d.decision_id,
                "action": ACTION_NAMES.get(d.action, str(d.action)),
                "version": d.version,
                "stable": d.stable,
                "actor": d.actor,
                "reason": d.reason,
                "share": d.share,
                "decided_at": _stamp(d),
                "refused": refused,
                "evidence": evidence(d.evidence_json),
            }
            for d, refused in book.decisions[max(0, len(book.decisions) - last) :]
        ],
    }


def render(book: RolloutBook, last: int) -> str:
    """The status as text."""
    from harnessrl.rollout import ACTION_NAMES

    state = book.fold.state
    if state.stable is None:
        return "no policy version has been announced yet"
    candidate = "none"
    if state.candidate is not None:
        candidate = f"v{state.candidate}, {state.share:.0%} of new production sessions"
    rolled_back = ", ".join(f"v{v}" for v in sorted(state.rolled_back)) or "none"
    out = [
        f"stable       v{state.stable}"
        + ("  (pinned: no candidate starts until unpin)" if state.pinned else ""),
        f"candidate    {candidate}",
        f"current      {_v(state.current())}  (the trainer's newest version not rolled back)",
        f"rolled back  {rolled_back}",
        "",
        "engines:" if book.engines else "engines: none has reported a load",
    ]
    width = max((len(name) for name in book.engines), default=0)
    for name, engine in sorted(book.engines.items()):
        served = ", ".join(f"v{v} ({m})" if m else f"v{v}" for v, m in engine.serving) or "-"
        failed = f"; last load failed: {engine.failed}" if engine.failed else ""
        out.append(f"  {name.ljust(width)}  {served}{failed}")
    shown = book.decisions[max(0, len(book.decisions) - last) :]
    out += [
        "",
        f"decisions (last {len(shown)} of {len(book.decisions)}):" if shown else "decisions: none",
    ]
    for decision, refused in shown:
        action = ACTION_NAMES.get(decision.action, str(decision.action))
        head = f"  {_stamp(decision) or '-'}  {action} v{decision.version} by {decision.actor}"
        if decision.reason:
            head += f" ({decision.reason})"
        if action == "start":
            head += f", share {decision.share:.0%}"
        out.append(head + (f"  REFUSED: {refused}" if refused else ""))
        line = evidence_line(decision)
        if line:
            out.append(f"      {line}")
    return "\n".join(out)


def run_status(args: argparse.Namespace) -> int:
    if args.decisions < 0:
        raise CliError("--decisions: must be at least 0")
    config = _config(args)
    book = _read(config, read_book(config.kafka))
    if args.json:
        print(json.dumps(status_json(book, args.decisions), indent=2))
    else:
        print(render(book, args.decisions))
    return 0


def run_decide(args: argparse.Namespace) -> int:
    operator = args.by or os.environ.get("USER", "")
    if not _NAME.fullmatch(operator):
        raise CliError(
            f"--by: {operator!r} is not an operator name (letters, digits, . _ @ -; at most 64)"
            if operator
            else "--by: give the operator's name (no $USER to default to)"
        )
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise CliError(f"--timeout: {args.timeout} is not a positive number of seconds")
    version = _version(getattr(args, "version", None))
    config = _config(args)
    return _read(config, _decide(config, args, f"operator:{operator}", version))


def _version(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text.removeprefix("v"))
    except ValueError:
        value = -1
    if value < 0:
        raise CliError(f"VERSION: {text!r} is not a policy version number")
    return value


def build(
    action: str, version: int | None, state: Rollout, actor: str, reason: str
) -> pb.RolloutDecision:
    """The operator's decision against `state`; VERSION defaults as each action's help says."""
    from harnessrl.v1 import events_pb2 as pb

    stable = state.stable if state.stable is not None else 0
    if version is None:
        version = state.candidate if state.candidate is not None else stable
    decision = pb.RolloutDecision(
        decision_id=uuid.uuid4().hex,
        action=getattr(pb, f"ROLLOUT_ACTION_{action.upper()}"),
        version=version,
        stable=stable,
        actor=actor,
        reason=reason,
    )
    decision.decided_at.FromNanoseconds(time.time_ns())
    return decision


async def _decide(
    config: ServiceConfig, args: argparse.Namespace, actor: str, version: int | None
) -> int:
    from harnessrl.rollout import refusal

    book = await read_book(config.kafka)
    state = book.fold.state
    if (
        args.action == "promote"
        and version is None
        and state.candidate is None
        and state.stable is not None
    ):
        return _refused(args.action, "no candidate is pending; name the VERSION to promote")
    decision = build(args.action, version, state, actor, args.reason)
    reason = refusal(state, decision)
    if reason is not None:
        return _refused(args.action, reason)
    await _publish(config, decision, args.timeout)
    deadline = time.monotonic() + args.timeout
    while True:
        book = await read_book(config.kafka)
        seen, refused = book.fold.outcome(decision.decision_id)
        if seen:
            break
        if time.monotonic() > deadline:
            raise CliError(
                f"decision {decision.decision_id} was published but not read back from "
                f"hrl.policy within {args.timeout:g}s"
            )
        await asyncio.sleep(0.2)
    if refused is not None:
        print(
            f"harnessrl policy {args.action}: published, but refused where it landed "
            f"(another decision came first): {refused}",
            file=sys.stderr,
        )
        return 1
    print(
        f"harnessrl policy {args.action}: applied (decision {decision.decision_id})",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps({"decision_id": decision.decision_id, **status_json(book, 10)}, indent=2))
    else:
        print(render(book, 10))
    return 0


def _refused(action: str, reason: str) -> int:
    print(f"harnessrl policy {action}: {reason}", file=sys.stderr)
    return 2


async def _publish(config: ServiceConfig, decision: pb.RolloutDecision, timeout: float) -> None:
    import tempfile
    from pathlib import Path

    from harnessrl.bus import Producer

    # A private spill directory: a decision not acknowledged now must never be sent later
    # by surprise (against a state it was not checked against); the command says so instead.
    with tempfile.TemporaryDirectory(prefix="harnessrl-policy-") as spill:
        settings = config.producer.model_copy(update={"spill_dir": Path(spill), "wal": False})
        producer = Producer(config.kafka, settings, name=f"policy/{config.instance}")
        await producer.start()
        try:
            await asyncio.wait_for(producer.publish(decision), timeout)
        except TimeoutError:
            raise CliError(
                f"the broker at {config.kafka.bootstrap_servers} did not acknowledge decision "
                f"{decision.decision_id} within {timeout:g}s; it is not sent again (`harnessrl "
                "policy status` shows whether it landed)"
            ) from None
        finally:
            await producer.stop(timeout=1.0)


def _config(args: argparse.Namespace) -> ServiceConfig:
    from harnessrl.config import ServiceConfig

    return load(ServiceConfig, args)


def _read(config: ServiceConfig, work: Coroutine[Any, Any, T]) -> T:
    """Run `work`; an unreachable broker is one CliError line."""
    from aiokafka.errors import KafkaError

    try:
        return asyncio.run(work)
    except (KafkaError, OSError) as err:
        where = config.kafka.bootstrap_servers
        raise CliError(f"cannot reach hrl.policy at {where}: {err!r}") from None
