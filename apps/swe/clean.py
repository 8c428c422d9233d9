"""The cleaning checks that need no environment: schema, problem statements, gold patches,
test counts, duplicates; and the split by project.

Checks run in this order, a task dropped at its first failure with one reason:

- schema: the record is not a task (see tasks.parse_task); the reason names the field;
- empty_statement: fewer than `min_statement_chars` characters of problem statement;
- empty_patch: the gold patch changes nothing;
- patch_touches_tests: the gold patch changes test code or test configuration (the fix
  must be in the code under test; tests come with `test_patch`);
- statement_leaks_patch: a line the gold patch adds (of 12 characters or more, comments
  aside), or the whole change of a one-line fix, is in the problem statement;
- no_failing_tests / too_many_failing_tests / too_many_tests: FAIL_TO_PASS empty or longer
  than `max_fail_to_pass`, FAIL_TO_PASS + PASS_TO_PASS longer than `max_tests`;
- duplicate_id, duplicate_patch (the same change, whitespace and hunk positions aside),
  duplicate_failing_tests (the same FAIL_TO_PASS in the same project) and
  near_duplicate_statement (word 3-gram Jaccard similarity >= `near_duplicate` with a kept
  task of the same project): the first in input order is kept.

Projects, never tasks, are split: no project has tasks in both train and val.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from harnessrl.apps.swe.swebench import SchemaError, SweTask, is_test_path, patch_paths

_WORD = re.compile(r"\w+")
_HUNK = re.compile(r"^@@ [^@]* @@", re.M)
_COMMENT = re.compile(r"\s+#[^'\"]*$")
_INDEX = re.compile(r"^index [0-9a-f]+\.\.[0-9a-f]+.*$", re.M)
LEAK_CHARS = 12
"""An added line shorter than this (`return x`, `)`) is too common to count as a leak."""


@dataclass(frozen=True, slots=True)
class CleanSettings:
    min_statement_chars: int = 40
    max_fail_to_pass: int = 20
    max_tests: int = 5000
    near_duplicate: float = 0.9
    val_fraction: float = 0.2


@dataclass(slots=True)
class Report:
    """Counts of one clean run: what was read, kept and dropped, by reason."""

    read: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    """Up to three instance ids (or line numbers) per drop reason."""

    def drop(self, reason: str, what: str) -> None:
        self.dropped[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < 3:
            shown.append(what)

    def as_json(self) -> dict[str, object]:
        return {
            "read": self.read,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
            "examples": dict(sorted(self.examples.items())),
        }


def clean(
    records: Iterable[tuple[int, SweTask | SchemaError]], settings: CleanSettings
) -> tuple[list[SweTask], Report]:
    """The tasks that pass every check, in input order, and the report."""
    report = Report()
    kept: list[SweTask] = []
    seen = _KeptTask()
    for number, item in records:
        report.read += 1
        if isinstance(item, SchemaError):
            report.drop(f"schema:{item.field or 'record'}", f"line {number}: {item}")
            continue
        reason = _check(item, settings)
        if reason is None:
            reason = seen.duplicate(item, settings.near_duplicate)
        if reason is not None:
            report.drop(reason, item.instance_id)
            continue
        kept.append(item)
    report.kept = len(kept)
    return kept, report


def _check(task: SweTask, settings: CleanSettings) -> str | None:
    if len(task.problem_statement.strip()) < settings.min_statement_chars:
        return "empty_statement"
    added, removed = _changed_lines(task.patch)
    if not added and not removed:
        return "empty_patch"
    if any(is_test_path(path) for path in patch_paths(task.patch)):
        return "patch_touches_tests"
    if _leaks(task.problem_statement, added, removed):
        return "statement_leaks_patch"
    if not task.fail_to_pass:
        return "no_failing_tests"
    if len(task.fail_to_pass) > settings.max_fail_to_pass:
        return "too_many_failing_tests"
    if len(task.fail_to_pass) + len(task.pass_to_pass) > settings.max_tests:
        return "too_many_tests"
    return None


class _KeptTask:
    """What the kept tasks hold, to tell a duplicate."""

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.patches: set[bytes] = set()
        self.failing: set[tuple[str, frozenset[str]]] = set()
        self.shingles: dict[str, list[frozenset[str]]] = {}

    def duplicate(self, task: SweTask, near: float) -> str | None:
        """The duplicate reason, or None after recording the task as kept."""
        if task.instance_id in self.ids:
            return "duplicate_id"
        patch = _normal_patch(task.patch)
        if patch in self.patches:
            return "duplicate_patch"
        tests = (task.project, frozenset(task.fail_to_pass))
        if tests in self.failing:
            return "duplicate_failing_tests"
        mine = _shingles(task.problem_statement)
        for other in self.shingles.get(task.project, ()):
            union = len(mine | other)
            if union and len(mine & other) / union >= near:
                return "near_duplicate_statement"
        self.ids.add(task.instance_id)
        self.patches.add(patch)
        self.failing.add(tests)
        self.shingles.setdefault(task.project, []).append(mine)
        return None


def _changed_lines(patch: str) -> tuple[list[str], list[str]]:
    added, removed = [], []
    for line in patch.splitlines():
        if line.startswith(("+++", "---")):
            continue
        if line.startswith("+") and line[1:].strip():
            added.append(line[1:].strip())
        elif line.startswith("-") and line[1:].strip():
            removed.append(line[1:].strip())
    return added, removed


def _leaks(statement: str, added: list[str], removed: list[str]) -> bool:
    """Whether the statement quotes the fix (its lines compared without trailing comments
    and with runs of spaces as one)."""
    text = " ".join(statement.split())
    added = [_COMMENT.sub("", line) for line in added]
    removed = [_COMMENT.sub("", line) for line in removed]
    if any(len(line) >= LEAK_CHARS and " ".join(line.split()) in text for line in added):
        return True
    # A one-line fix whose new line is short: leaked when the statement quotes the old
    # and the new line both.
    if len(added) == 1 and len(removed) == 1:
        return " ".join(added[0].split()) in text and " ".join(removed[0].split()) in text
    return False


def _normal_patch(patch: str) -> bytes:
    """The change itself: index lines, hunk positions and whitespace inside lines dropped."""
    body = _HUNK.sub("@@", _INDEX.sub("", patch))
    lines = [" ".join(line.split()) for line in body.splitlines() if line.strip()]
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=16).digest()


def _shingles(statement: str) -> frozenset[str]:
    words = _WORD.findall(statement.lower())
    if len(words) < 3:
        return frozenset([" ".join(words)])
    return frozenset(" ".join(words[i : i + 3]) for i in range(len(words) - 2))


def split_by_project(tasks: Iterable[SweTask], val_fraction: float) -> dict[str, str]:
    """Project -> "train" or "val": projects in a fixed pseudo-random order (a hash of the
    name) go to val until it holds about `val_fraction` of the tasks; with two or more
    projects each split gets at least one, and no project is in both."""
    counts = Counter(task.project for task in tasks)
    order = sorted(counts, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    total = sum(counts.values())
    splits = dict.fromkeys(order, "train")
    in_val = 0
    for project in order:
        if len(order) < 2 or in_val >= val_fraction * total:
            break
        if in_val and in_val + counts[project] > val_fraction * total * 1.5:
            continue  # would overshoot; a smaller project may fit
        splits[project] = "val"
        in_val += counts[project]
    if len(order) >= 2 and "train" not in splits.values():
        splits[order[-1]] = "train"
    return splits
