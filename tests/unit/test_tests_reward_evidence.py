"""builtin:tests' reading of a run: the test guard's frames, authenticated and cross-checked
(`evidence`), which named test means which node ids (`test_names`), and the score and flags
that follow (`grading`).

The frames are written here as the guard writes them (`testguard._Channel`, the module the
jail mounts into the task's environment), so what the reward accepts is pinned to what the
guard sends."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import Any

import orjson
import pytest

from harnessrl.services.reward import config
from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.evidence import (
    Evidence,
    all_outcomes,
    inconsistencies,
    outcome_of,
    read,
)
from harnessrl.services.reward.grading import grade
from harnessrl.services.reward.group_run import RunOutcome
from harnessrl.services.reward.test_names import address_of, status_of

KEY = bytes(range(32))


def frame(record: dict[str, Any], n: int, key: bytes = KEY) -> bytes:
    payload = orjson.dumps(record | {"n": n})
    return (
        struct.pack(">I", len(payload)) + hmac.new(key, payload, hashlib.sha256).digest() + payload
    )


def stream(*records: dict[str, Any]) -> bytes:
    return b"".join(frame(r, n) for n, r in enumerate(records))


def hello(**more: Any) -> dict[str, Any]:
    return {"k": "hello", "pid": 1, "preloaded": [], **more}


def collected(*nodeids: str) -> dict[str, Any]:
    return {"k": "collected", "nodeids": list(nodeids)}


def ran(nodeid: str, outcome: str = "passed", raised: str | None = None) -> list[dict[str, Any]]:
    """The frames of one test: setup, the guard's view of the call, call, teardown."""
    return [
        {"k": "test", "nodeid": nodeid, "when": "setup", "outcome": "passed"},
        {"k": "call", "nodeid": nodeid, "raised": raised},
        {"k": "test", "nodeid": nodeid, "when": "call", "outcome": outcome, "text": "boom"},
        {"k": "test", "nodeid": nodeid, "when": "teardown", "outcome": "passed"},
    ]


def end(status: int) -> dict[str, Any]:
    return {"k": "end", "exitstatus": status}


A, B = "tests/test_x.py::test_a", "tests/test_x.py::test_b"


def test_the_guards_own_channel_writes_frames_the_reward_reads() -> None:
    """The guard module's writer, on a real pipe, read back by `evidence.read`."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "guard_under_test", Path(__file__).parents[2] / "services/reward/testguard.py"
    )
    assert spec is not None and spec.loader is not None
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)  # no HARNESSRL_GUARD_FD here: the module stays inert
    assert guard._CHANNEL is None
    r, w = os.pipe()
    channel = guard._Channel(w, KEY)
    for record in (hello(), collected(A), *ran(A), end(0)):
        channel.send(record)
    channel.close()
    data = os.read(r, 1 << 20)
    os.close(r)
    evidence = read(data, KEY)
    assert (evidence.forged, evidence.exitstatus) == ([], 0)
    assert all_outcomes(evidence) == {A: "passed"}


def test_a_clean_run_adds_up() -> None:
    data = stream(hello(), collected(A, B), *ran(A), *ran(B, "failed", "AssertionError"), end(1))
    evidence = read(data, KEY)
    assert all_outcomes(evidence) == {A: "passed", B: "failed"}
    assert inconsistencies(evidence, 1) == []
    assert evidence.texts == {B: "boom"}


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (frame(hello(), 0, key=b"x" * 32), "a frame that does not verify"),
        (stream(hello()) + frame(collected(A), 5), "a frame out of sequence (expected 1)"),
        (stream(hello())[:-3], "a truncated frame"),
        (stream(hello(), collected(A), *ran(B)), f"{B}: reported, never collected"),
        (
            stream(hello(), collected(A), *ran(A), ran(A)[2]),
            f"{A}: its call reported twice",
        ),
    ],
    ids=["bad-mac", "sequence", "truncated", "not-collected", "twice"],
)
def test_frames_that_do_not_fit_are_named_forged(data: bytes, problem: str) -> None:
    evidence = read(data, KEY)
    assert problem in evidence.forged or any(problem in f for f in evidence.forged)
    assert inconsistencies(evidence, 0)[0][0] in ("report_forged", "guard_missing")


def test_frames_after_the_end_are_counted_not_taken() -> None:
    data = stream(hello(), collected(A), *ran(A, "failed", "AssertionError"), end(1), *ran(A))
    evidence = read(data, KEY)
    assert evidence.after_end == 4
    assert all_outcomes(evidence) == {A: "failed"}
    assert ("report_after_finish", "4 report frame(s) written after the runner finished") in (
        inconsistencies(evidence, 1)
    )


@pytest.mark.parametrize(
    ("records", "exit_code", "flag"),
    [
        ((collected(A), *ran(A, "passed", "builtins.AssertionError"), end(0)), 0, "report_forged"),
        (
            (collected(A), ran(A)[0], ran(A)[2], ran(A)[3], end(0)),
            0,
            "report_forged",
        ),  # a call the guard never saw
        ((collected(A), *ran(A), end(0)), 1, "exit_mismatch"),
        ((collected(A), *ran(A, "failed", "AssertionError"), end(0)), 0, "exit_mismatch"),
        ((collected(A), *ran(A), end(1)), 1, "exit_mismatch"),
        (
            (collected(A), {"k": "tamper", "found": ["runner changed: x"]}, end(0)),
            0,
            "runner_tampered",
        ),
    ],
    ids=[
        "passed-but-raised",
        "unseen-call",
        "exit-status",
        "zero-with-failure",
        "one-without",
        "tamper",
    ],
)
def test_runs_that_do_not_add_up_are_flagged(
    records: tuple[dict[str, Any], ...], exit_code: int, flag: str
) -> None:
    evidence = read(stream(hello(), *records), KEY)
    assert flag in [f for f, _ in inconsistencies(evidence, exit_code)]


def test_a_skip_or_xfail_raised_by_the_call_is_not_a_failure() -> None:
    records = [
        *ran(A, "skipped", "_pytest.outcomes.Skipped"),
        {"k": "test", "nodeid": B, "when": "setup", "outcome": "passed"},
        {"k": "call", "nodeid": B, "raised": "builtins.AssertionError"},
        {"k": "test", "nodeid": B, "when": "call", "outcome": "skipped", "xfail": True},
        {"k": "test", "nodeid": B, "when": "teardown", "outcome": "passed"},
    ]
    evidence = read(stream(hello(), collected(A, B), *records, end(0)), KEY)
    assert inconsistencies(evidence, 0) == []
    assert all_outcomes(evidence) == {A: "skipped", B: "xfailed"}


def test_outcome_needs_every_phase() -> None:
    evidence = Evidence(collected=(A,))
    evidence.phases[A] = {"setup": "passed", "call": "passed"}
    assert outcome_of(evidence, A) is None  # teardown never reported: the run stopped
    evidence.phases[A]["teardown"] = "failed"
    assert outcome_of(evidence, A) == "error"
    evidence.phases[B] = {"setup": "failed", "teardown": "passed"}
    assert outcome_of(evidence, B) == "error"


def test_no_hello_is_guard_missing() -> None:
    assert inconsistencies(read(b"", KEY), 0) == [
        ("guard_missing", "the test guard never reported: pytest did not load it")
    ]


OUTCOMES: dict[str, Any] = {
    "tests/test_x.py::test_a": "passed",
    "tests/test_x.py::test_b": "failed",
    "tests/test_x.py::TestK::test_c": "passed",
    "tests/test_x.py::test_p[1]": "passed",
    "tests/test_x.py::test_p[2]": "error",
    "tests/test_y.py::test_s": "skipped",
}
COLLECTORS = {"tests/test_skipped.py": "skipped", "tests/test_broken.py": "failed"}


@pytest.mark.parametrize(
    ("named", "status"),
    [
        ("tests/test_x.py::test_a", "passed"),
        ("tests.test_x.test_a", "passed"),
        ("test_x.py::test_a", "passed"),
        ("test_a", "passed"),
        ("tests/test_x.py::test_b", "failed"),
        ("tests/test_x.py::TestK::test_c", "passed"),
        ("tests/test_x.py::test_p[1]", "passed"),
        ("tests/test_x.py::test_p", "error"),  # every parametrised case counts
        ("tests/test_y.py::test_s", "skipped"),
        ("tests/test_skipped.py::test_k", "skipped"),  # held by its module
        ("test_broken.py::TestK::test_b[1]", "error"),
        ("tests/test_x.py::test_zz", None),
        ("st_a", None),  # a suffix counts only at a dot
    ],
)
def test_named_tests_match_node_ids_generously(named: str, status: str | None) -> None:
    assert status_of(named, OUTCOMES, COLLECTORS) == status


def test_address_is_pytest_junit_form_of_node_id() -> None:
    assert address_of("tests/test_x.py::TestA::test_b[1]") == "tests.test_x.TestA.test_b[1]"


def _task(**metadata: Any) -> CodingTask:
    base = {
        "repo": "/srv/repo.git",
        "base_commit": "main",
        "test_command": ["python", "-m", "pytest", "--junitxml={junit_xml}"],
        "tests": ["test_x.py::test_a", "test_x.py::test_b"],
        "protected_paths": [],
    }
    return CodingTask.from_metadata(base | metadata, config.TestsSettings())


def _run(outcomes: dict[str, str], status: int, *more: dict[str, Any]) -> Evidence:
    records: list[dict[str, Any]] = [hello(), collected(*outcomes)]
    for nodeid, outcome in outcomes.items():
        raised = None if outcome == "passed" else "AssertionError"
        if outcome == "skipped":
            raised = "_pytest.outcomes.Skipped"
        records += ran(nodeid, outcome, raised)
    return read(stream(*records, *more, end(status)), KEY)


def _exited(code: int) -> RunOutcome:
    return RunOutcome(exit_code=code, timed_out=False, output_tail=b"")


@pytest.mark.parametrize(
    ("outcomes", "status", "value", "flags"),
    [
        ({"test_x.py::test_a": "passed", "test_x.py::test_b": "passed"}, 0, 1.0, ()),
        ({"test_x.py::test_a": "passed", "test_x.py::test_b": "failed"}, 1, 0.5, ()),
        ({"test_x.py::test_a": "passed"}, 0, 0.0, ("tests_missing",)),
        (
            {"test_x.py::test_a": "passed", "test_x.py::test_b": "skipped"},
            0,
            0.0,
            ("tests_skipped",),
        ),
        (
            {
                "test_x.py::test_a": "passed",
                "test_x.py::test_b": "passed",
                "test_z.py::t": "failed",
            },
            1,
            0.0,
            ("tests_regressed",),
        ),
    ],
    ids=["all", "half", "missing", "skipped", "regressed"],
)
def test_grade_counts_passes_and_zeroes_what_does_not_hold(
    outcomes: dict[str, str], status: int, value: float, flags: tuple[str, ...]
) -> None:
    task = _task(known_failures=[])
    score = grade(task, _exited(status), _run(outcomes, status), ["x.py"])
    assert (score.value, score.flags) == (value, flags), score.message


def test_without_known_failures_tests_outside_the_named_ones_are_not_judged() -> None:
    outcomes = {"test_x.py::test_a": "passed", "test_x.py::test_b": "passed", "t.py::t": "failed"}
    score = grade(_task(), _exited(1), _run(outcomes, 1), [])
    assert (score.value, score.flags) == (1.0, ())
    known = grade(_task(known_failures=["t.py::t"]), _exited(1), _run(outcomes, 1), [])
    assert (known.value, known.flags) == (1.0, ())


def test_grade_zeroes_a_run_that_does_not_add_up_with_every_flag() -> None:
    outcomes = {"test_x.py::test_a": "passed", "test_x.py::test_b": "passed"}
    tampered = _run(outcomes, 0, {"k": "tamper", "found": ["runner changed: x"]})
    score = grade(_task(), _exited(1), tampered, [])
    assert (score.value, score.flags) == (0.0, ("runner_tampered", "exit_mismatch"))
    assert "runner changed: x" in score.message


def test_grade_without_the_end_of_the_session_is_early_exit() -> None:
    evidence = read(stream(hello(), collected("test_x.py::test_a")), KEY)
    score = grade(_task(), _exited(0), evidence, [])
    assert (score.value, score.flags) == (0.0, ("early_exit",))


def test_grade_flags_patched_code_imported_before_the_guard() -> None:
    outcomes = {"test_x.py::test_a": "passed", "test_x.py::test_b": "passed"}
    records = [hello(preloaded=["pkg/core.py", "pkg/other.py"]), collected(*outcomes)]
    for nodeid in outcomes:
        records += ran(nodeid)
    evidence = read(stream(*records, end(0)), KEY)
    assert grade(_task(), _exited(0), evidence, ["pkg/other.py"]).flags == ("runner_tampered",)
    assert grade(_task(), _exited(0), evidence, ["pkg/new.py"]).value == 1.0


def test_internal_error_and_timeout() -> None:
    evidence = read(stream(hello(), collected(), end(3)), KEY)
    assert grade(_task(), _exited(3), evidence, []).flags == ("runner_error",)
    timed_out = RunOutcome(exit_code=None, timed_out=True, output_tail=b"")
    assert grade(_task(), timed_out, None, []).flags == ("timeout",)


def test_runner_command_is_scored_by_its_exit_status_alone() -> None:
    task = _task(runner="command", tests=[])
    assert grade(task, _exited(0), None, []).value == 1.0
    assert grade(task, _exited(2), None, []).value == 0.0


def test_subtests_are_many_reports_of_one_call_and_a_failed_one_fails_the_test() -> None:
    sub = {"k": "test", "nodeid": A, "when": "call", "sub": True, "text": "sub boom"}
    records = [
        ran(A)[0],
        ran(A)[1],
        sub | {"outcome": "passed"},
        sub | {"outcome": "failed"},
        sub | {"outcome": "passed"},
        ran(A)[2],
        ran(A)[3],
    ]
    evidence = read(stream(hello(), collected(A), *records, end(1)), KEY)
    assert evidence.forged == []
    assert all_outcomes(evidence) == {A: "failed"}
    assert inconsistencies(evidence, 1) == []
    assert evidence.texts[A] == "sub boom"
