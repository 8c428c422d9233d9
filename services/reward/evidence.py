"""What a jailed test run proved: the test guard's frames, authenticated, cross-checked.

The guard (`testguard.py`) writes numbered frames `len (u32) | HMAC-SHA256 | JSON payload`
to a pipe the reward reads, under a key that only the guard and the reward hold. `read` turns
the bytes into `Evidence`; every frame that does not verify, is out of sequence, or does not
fit the run (a second report of one phase, a report of a test that was not collected, a
call reported passed that the guard saw raise) is a named problem, never silently dropped.

Outcomes of a test (`outcome_of`), from the phases pytest reported and what the guard's own
wrapper saw the call raise:

- error: a setup or teardown phase failed (or a module failed to collect);
- failed: the call failed (a strict xfail that passed included), or one of its subtests;
- skipped / xfailed / xpassed: as pytest marks them;
- passed: setup, call and teardown passed, the call observed raising nothing;
- None: not collected, or not run to its end (the run stopped).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Outcome = Literal["passed", "failed", "error", "skipped", "xfailed", "xpassed"]
KEY_BYTES = 32
_HEADER = struct.Struct(">I")
_MAC_BYTES = 32
FRAME_LIMIT = 64 * 1024 * 1024
"""A larger frame is not read (the guard never writes one)."""
_SKIP_RAISES = ("Skipped", "XFailed", "SkipTest")
"""Exceptions by which a test's call skips or xfails rather than fails."""


@dataclass(slots=True)
class Evidence:
    """Everything the guard reported, and what did not add up."""

    hello: Mapping[str, Any] | None = None
    collected: tuple[str, ...] | None = None
    collect_problems: dict[str, str] = field(default_factory=dict)
    """Collector node id (a module, a directory) -> "failed" or "skipped"."""
    phases: dict[str, dict[str, str]] = field(default_factory=dict)
    """Node id -> phase ("setup", "call", "teardown") -> outcome ("passed", "failed",
    "skipped", or "xfailed" / "xpassed" where pytest marked the report)."""
    subtests: dict[str, list[str]] = field(default_factory=dict)
    """Node id -> the outcomes of its subtests (unittest's subTest, pytest's subtests)."""
    raised: dict[str, str | None] = field(default_factory=dict)
    """Node id -> the exception the call raised, as the guard saw it (None: nothing)."""
    texts: dict[str, str] = field(default_factory=dict)
    """Node id -> pytest's text for its first phase that did not pass."""
    tampering: list[str] = field(default_factory=list)
    exitstatus: int | None = None
    """pytest's exit status as the guard reported it at the session's end."""
    after_end: int = 0
    """Frames that arrived after the end frame."""
    forged: list[str] = field(default_factory=list)
    """Frames that do not verify or do not fit the run, in words."""
    overflowed: bool = False
    """The run wrote more into the channel than the reward reads (the rest was dropped)."""

    @property
    def ended(self) -> bool:
        return self.exitstatus is not None


def read(data: bytes, key: bytes, overflowed: bool = False) -> Evidence:
    """The evidence in the channel's bytes (see the module docstring); `overflowed`: the
    channel held more than these bytes (the jail read no further)."""
    evidence = Evidence(overflowed=overflowed)
    at, expected = 0, 0
    while at < len(data):
        if len(data) - at < _HEADER.size + _MAC_BYTES:
            evidence.forged.append("a truncated frame")
            break
        (size,) = _HEADER.unpack_from(data, at)
        start = at + _HEADER.size + _MAC_BYTES
        if size > FRAME_LIMIT or start + size > len(data):
            evidence.forged.append("a truncated frame")
            break
        mac, payload = data[at + _HEADER.size : start], data[start : start + size]
        at = start + size
        if not hmac.compare_digest(mac, hmac.new(key, payload, hashlib.sha256).digest()):
            evidence.forged.append("a frame that does not verify")
            continue
        try:
            record = orjson.loads(payload)
        except orjson.JSONDecodeError:
            evidence.forged.append("a frame that is not JSON")
            continue
        if not isinstance(record, dict) or record.get("n") != expected:
            evidence.forged.append(f"a frame out of sequence (expected {expected})")
            expected = record.get("n", expected) + 1 if isinstance(record, dict) else expected
            continue
        expected += 1
        if evidence.ended:
            evidence.after_end += 1
            continue
        _take(evidence, record)
    return evidence


def _take(evidence: Evidence, record: dict[str, Any]) -> None:
    kind = record.get("k")
    if kind == "hello" and evidence.hello is None:
        evidence.hello = record
    elif kind == "collected" and evidence.collected is None:
        nodeids = record.get("nodeids")
        evidence.collected = tuple(str(n) for n in nodeids) if isinstance(nodeids, list) else ()
    elif kind == "collect":
        evidence.collect_problems[str(record.get("nodeid"))] = str(record.get("outcome"))
    elif kind == "test":
        _take_phase(evidence, record)
    elif kind == "call":
        nodeid = str(record.get("nodeid"))
        if nodeid in evidence.raised:
            evidence.forged.append(f"{nodeid}: its call reported twice")
        raised = record.get("raised")
        evidence.raised[nodeid] = str(raised) if raised is not None else None
    elif kind == "tamper":
        found = record.get("found")
        if isinstance(found, list):
            evidence.tampering.extend(str(f) for f in found)
    elif kind == "end":
        status = record.get("exitstatus")
        evidence.exitstatus = status if isinstance(status, int) else -1
    else:
        evidence.forged.append(f"an unexpected frame {str(kind)[:20]!r}")


def _take_phase(evidence: Evidence, record: dict[str, Any]) -> None:
    nodeid, when = str(record.get("nodeid")), str(record.get("when"))
    if evidence.collected is None or nodeid not in set(evidence.collected):
        evidence.forged.append(f"{nodeid}: reported, never collected")
        return
    if record.get("sub"):  # one of a test's subtests: as many as it has, none a phase
        outcome = str(record.get("outcome"))
        evidence.subtests.setdefault(nodeid, []).append(outcome)
        if outcome == "failed" and nodeid not in evidence.texts:
            evidence.texts[nodeid] = str(record.get("text", ""))
        return
    phases = evidence.phases.setdefault(nodeid, {})
    if when in phases:
        evidence.forged.append(f"{nodeid}: its {when} reported twice")
        return
    outcome = str(record.get("outcome"))
    if record.get("xfail"):
        outcome = "xfailed" if outcome == "skipped" else "xpassed"
    phases[when] = outcome
    if outcome not in ("passed", "xpassed") and nodeid not in evidence.texts:
        evidence.texts[nodeid] = str(record.get("text", ""))


def outcome_of(evidence: Evidence, nodeid: str) -> Outcome | None:
    """The test's outcome (see the module docstring)."""
    phases = evidence.phases.get(nodeid)
    if not phases:
        return None
    setup, call, teardown = (phases.get(w) for w in ("setup", "call", "teardown"))
    if setup == "failed" or teardown == "failed":
        return "error"
    if setup in ("skipped", "xfailed"):
        return "skipped" if setup == "skipped" else "xfailed"
    if call is None or teardown is None:
        return None
    if call in ("failed", "skipped", "xfailed", "xpassed"):
        return call  # type: ignore[return-value]  # the phase outcomes are Outcome's
    if "failed" in evidence.subtests.get(nodeid, ()):
        return "failed"  # a test with a failed subtest fails, as pytest counts it
    return "passed"


def inconsistencies(evidence: Evidence, exit_code: int | None) -> list[tuple[str, str]]:
    """(flag, why) for each way the run does not add up; [] for a run the reward may grade.

    exit_code: the process's exit status as the reward saw it (None: killed at its timeout).
    """
    found: list[tuple[str, str]] = []
    if evidence.overflowed:
        found.append(("channel_overflow", "the run wrote more into its channel than is read"))
    if evidence.hello is None:
        return [*found, ("guard_missing", "the test guard never reported: pytest did not load it")]
    if evidence.forged:
        found.append(("report_forged", "; ".join(dict.fromkeys(evidence.forged))))
    for nodeid, phases in evidence.phases.items():
        raised = evidence.raised.get(nodeid, "absent")
        if "call" in phases and raised == "absent":
            found.append(("report_forged", f"{nodeid}: a call the guard did not see run"))
        elif phases.get("call") == "passed" and _failure(raised):
            why = f"{nodeid}: reported passed, but its call raised {raised}"
            found.append(("report_forged", why))
    if evidence.tampering:
        shown = "; ".join(dict.fromkeys(evidence.tampering))
        found.append(("runner_tampered", shown[:2000]))
    if evidence.after_end:
        why = f"{evidence.after_end} report frame(s) written after the runner finished"
        found.append(("report_after_finish", why))
    if not evidence.ended:
        return found
    if exit_code is not None and evidence.exitstatus != exit_code:
        why = f"pytest ended with status {evidence.exitstatus}, the process exited {exit_code}"
        found.append(("exit_mismatch", why))
    failing = _failing(evidence)
    if evidence.exitstatus == 0 and failing:
        why = f"exit status 0 with failing tests: {', '.join(failing[:5])}"
        found.append(("exit_mismatch", why))
    if evidence.exitstatus == 1 and not failing:
        found.append(("exit_mismatch", "exit status 1 (tests failed) but no test failed"))
    return found


def _failure(raised: str | None) -> bool:
    """Whether what a call raised (as the guard saw it) makes it fail: an exception other
    than a skip or an xfail ("absent": the guard did not see the call)."""
    return raised is not None and raised != "absent" and not raised.endswith(_SKIP_RAISES)


def _failing(evidence: Evidence) -> list[str]:
    failing = [n for n in evidence.phases if outcome_of(evidence, n) in ("failed", "error")]
    return failing + [n for n, o in evidence.collect_problems.items() if o == "failed"]


def all_outcomes(evidence: Evidence) -> dict[str, Outcome]:
    """Node id -> outcome, for every collected test that ran to its end."""
    found: dict[str, Outcome] = {}
    for nodeid in evidence.collected or ():
        outcome = outcome_of(evidence, nodeid)
        if outcome is not None:
            found[nodeid] = outcome
    return found
