"""Cleaning imported SWE-bench-format tasks (harnessrl.apps.swe.clean and .swebench): a
file in the public datasets' field names, one task per drop reason, the answers written
down; and the split by project."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from harnessrl.apps.swe.clean import CleanSettings, clean, split_by_project
from harnessrl.apps.swe.swebench import SweTask, is_test_path, patch_paths, read_records, to_record

STATEMENT = (
    "Calling `Money.split(3)` on 10.00 returns parts that add up to 9.99: a cent is lost "
    "whenever the amount does not divide evenly."
)
PATCH = """diff --git a/money/core.py b/money/core.py
index 3b18e51..a9c3f2d 100644
--- a/money/core.py
+++ b/money/core.py
@@ -40,7 +40,7 @@ class Money:
     def split(self, n):
         base, rest = divmod(self.cents, n)
-        parts = [base] * n
+        parts = [base + (1 if i < rest else 0) for i in range(n)]
         return [Money(p) for p in parts]
"""


FIXED_LINE = "parts = [base + (1 if i < rest else 0) for i in range(n)]"


def _task(instance: str, **fields: Any) -> dict[str, Any]:
    """A SWE-bench record (FAIL_TO_PASS as JSON text, as SWE-bench stores it)."""
    record = {
        "instance_id": instance,
        "repo": "acme/money",
        "base_commit": "3b18e51f00",
        "patch": PATCH.replace("range(n)", f"range(n)  # {instance}"),
        "test_patch": "",
        "problem_statement": f"{STATEMENT} Seen in {instance}.",
        "FAIL_TO_PASS": json.dumps([f"tests/test_split.py::test_{instance}"]),
        "PASS_TO_PASS": json.dumps(["tests/test_split.py::test_even"]),
        "version": "1.2",
        "created_at": "2024-05-01T00:00:00Z",
    }
    return record | fields


def _other(statement: str) -> str:
    return f"{statement} Unrelated words so the statements differ a lot: {statement[::-1]}"


def test_an_imported_file_goes_through_clean_with_every_drop_reason(tmp_path: Path) -> None:
    other_patch = PATCH.replace("base + (1", "base + (2")
    records: list[Any] = [
        _task("good-1"),
        _task("good-2", repo="acme/ledger", FAIL_TO_PASS=["t.py::test_a", "t.py::test_b"]),
        {k: v for k, v in _task("no-f2p").items() if k != "FAIL_TO_PASS"},
        _task("bad-f2p", FAIL_TO_PASS="[not json"),
        _task("bad-id", instance_id=" spaced "),
        _task("short", problem_statement="It breaks."),
        _task("nopatch", patch="diff --git a/x.py b/x.py\n"),
        _task("tests", patch=PATCH.replace("money/core.py", "tests/test_split.py")),
        _task("conftest", patch=PATCH.replace("money/core.py", "money/conftest.py")),
        _task("leak", problem_statement=f"{STATEMENT} Fix: {FIXED_LINE}"),
        _task("no-tests", FAIL_TO_PASS="[]"),
        _task("many-f2p", FAIL_TO_PASS=[f"t.py::test_{i}" for i in range(21)]),
        _task("many", PASS_TO_PASS=[f"t.py::test_p{i}" for i in range(5000)]),
        _task("good-1", repo="acme/other", problem_statement=_other(STATEMENT)),
        _task("same-patch", patch=_task("good-1")["patch"].replace("@@ -40,7", "@@ -41,7")),
        _task("same-tests", FAIL_TO_PASS=_task("good-1")["FAIL_TO_PASS"], patch=other_patch),
        _task("near", problem_statement=f"{STATEMENT} Seen in good-1!"),
    ]
    path = tmp_path / "swe.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records) + b"{oops\n\n")
    kept, report = clean(read_records(path), CleanSettings())
    assert [t.instance_id for t in kept] == ["good-1", "good-2"]
    assert kept[1].fail_to_pass == ("t.py::test_a", "t.py::test_b")  # a list, as SWE-Gym has it
    assert kept[0].fail_to_pass == ("tests/test_split.py::test_good-1",)  # JSON text
    assert kept[0].extra == {"version": "1.2", "created_at": "2024-05-01T00:00:00Z"}
    assert report.read == len(records) + 1 and report.kept == 2
    assert dict(report.dropped) == {
        "schema:FAIL_TO_PASS": 2,
        "schema:instance_id": 1,
        "schema:record": 1,
        "empty_statement": 1,
        "empty_patch": 1,
        "patch_touches_tests": 2,
        "statement_leaks_patch": 1,
        "no_failing_tests": 1,
        "too_many_failing_tests": 1,
        "too_many_tests": 1,
        "duplicate_id": 1,
        "duplicate_patch": 1,
        "duplicate_failing_tests": 1,
        "near_duplicate_statement": 1,
    }
    assert report.examples["patch_touches_tests"] == ["tests", "conftest"]
    (garbage,) = report.examples["schema:record"]
    assert garbage.startswith(f"line {len(records) + 1}: not JSON")
    assert json.loads(json.dumps(report.as_json()))["kept"] == 2


def test_a_task_reads_back_as_written() -> None:
    (item,) = [t for _, t in _records([_task("x", hints_text="see #12")])]
    assert isinstance(item, SweTask)
    assert to_record(item)["hints_text"] == "see #12"
    again = _records([to_record(item)])
    assert [t for _, t in again] == [item]


def _records(items: list[dict[str, Any]]) -> list[tuple[int, Any]]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.json"
        path.write_bytes(orjson.dumps(items))  # a JSON array file this time
        return list(read_records(path))


def test_patch_paths_and_test_paths() -> None:
    assert patch_paths(PATCH) == ["money/core.py"]
    created = "diff --git a/new.py b/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/new.py\n"
    assert patch_paths(created) == ["new.py"]
    for path in (
        "tests/a.py",
        "pkg/test/x.py",
        "test_a.py",
        "pkg/a_test.py",
        "conftest.py",
        "pkg/conftest.py",
        "tox.ini",
        "pytest.ini",
        "testing/util.py",
    ):
        assert is_test_path(path), path
    for path in ("pkg/core.py", "pkg/contest.py", "pkg/latest.py", "attestation/x.py"):
        assert not is_test_path(path), path


@pytest.mark.parametrize("projects", [1, 2, 5, 12])
def test_projects_are_split_never_their_tasks(projects: int) -> None:
    tasks = [
        SweTask(f"p{p}-{i}", f"org/p{p}", "c0", PATCH, STATEMENT, ("t::a",))
        for p in range(projects)
        for i in range(1 + p % 4)
    ]
    splits = split_by_project(tasks, 0.2)
    assert set(splits) == {t.project for t in tasks}
    if projects == 1:
        assert set(splits.values()) == {"train"}
        return
    assert set(splits.values()) == {"train", "val"}
    val = sum(1 for t in tasks if splits[t.project] == "val")
    assert 0 < val < len(tasks)
    assert splits == split_by_project(list(reversed(tasks)), 0.2)  # order does not matter


def test_the_cli_writes_the_kept_tasks_with_their_split_and_prints_the_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from harnessrl.apps.cli import main

    records = [_task("a-1"), _task("b-1", repo="acme/b"), _task("short", problem_statement="?")]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in records))
    out, report = tmp_path / "clean" / "out.jsonl", tmp_path / "report.json"
    code = main(["swe", "clean", str(path), "--out", str(out), "--report", str(report)])
    assert code == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == json.loads(report.read_text())
    assert (printed["read"], printed["kept"], printed["dropped"]) == (3, 2, {"empty_statement": 1})
    assert printed["projects"] == {"train": 1, "val": 1}
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["instance_id"] for w in written] == ["a-1", "b-1"]
    assert {w["split"] for w in written} == {"train", "val"}
    assert main(["swe", "clean", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
