"""`swe synth`: real coding tasks made from pinned open-source projects by injecting bugs
(SWE-smith's procedure, without an LLM).

For each project, in stages, each of which a rerun skips when its result is on disk:

1. fetch: the pinned sdist as a git repository (`fetch.checkout`);
2. environment: a venv with pytest and the test requirements, never the project
   (`env.environment`);
3. baseline: the suite run `runs` times; a test is reliable when it PASSED every time, flaky
   when it passed only some of the time (flaky tests are in no task);
4. candidates: AST mutations of the project's code, never its tests (`mutate.mutations`), a
   seeded sample of at most `candidates` per project, in a seeded order;
5. check: each candidate runs the whole suite once; FAIL_TO_PASS is the reliable tests that
   no longer pass: every test the bug makes fail anywhere in the suite. Kept when
   1 <= |FAIL_TO_PASS| <= `max_fail_to_pass` (so every other reliable test still passes)
   and no kept task of the project has the same FAIL_TO_PASS; at most `per_project` are
   kept (a bug that stops pytest itself, a conftest that no longer imports, is dropped as
   `runner_broken`; one whose run does not add up under the guard as `unguarded`). The
   task's command runs the whole suite when its baseline run takes at most
   `full_suite_s`, else (as in SWE-bench) the test files of its FAIL_TO_PASS; PASS_TO_PASS
   is every other reliable test the command runs, and `known_failures` the tests it runs
   that failed in a baseline run (the only tests besides the named ones allowed to fail:
   builtin:tests scores 0 a patch that makes any other test fail, named or not);
6. task: a repository of one commit holding the buggy tree and nothing else (no history,
   no pristine file, not even as an unreachable object), the gold patch (the fix, as a
   `git diff` would write it), and a problem statement written from what fails. When the
   bug breaks several test functions, half of them are held back (`holdback`): cut from
   the repository's test files, restored by the task's `test_patch` in the reward's copy
   only, and left out of the problem statement.

Output, under `out`:

    tasks.jsonl            SWE-bench-format records (see tasks.py), with the project, its
                           environment and the test command `clean --validate` and
                           builtin:tests run (`project`, `environment`, `test_command`)
    report.json            counts per stage and drop reasons, wall time per stage
    deploy/                a Dockerfile and a Kubernetes Job template per project (deploy.py)
    repos/<id>.git         one bare repository per task
    envs/<name>-<version>  the environments (a task's `environment`)
    work/                  sdists, pristine checkouts, per-candidate results (for resuming);
                           never in an agent's reach

Candidates are checked by `jobs` workers, each in its own copy of the project; a test run
that hangs is cut at `timeout_factor` times the baseline's duration (plus 30 s); a rerun
checks the candidates that timed out again (the machine may have been busy).
"""

from __future__ import annotations

import hashlib
import heapq
import queue
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from harnessrl.apps.swe import deploy
from harnessrl.apps.swe import env as envs
from harnessrl.apps.swe.baseline import Baseline, measure
from harnessrl.apps.swe.fetch import checkout
from harnessrl.apps.swe.holdback import choose, cut, function_of
from harnessrl.apps.swe.mutate import Mutation, mutations
from harnessrl.apps.swe.projects import Project
from harnessrl.apps.swe.repository import export, task_repository, unified_patch
from harnessrl.apps.swe.statement import Failure, problem_statement
from harnessrl.apps.swe.swebench import is_test_path

STAGES = ("fetch", "environment", "baseline", "candidates", "check", "task")


@dataclass(frozen=True, slots=True)
class SynthSettings:
    runs: int = 3
    """Baseline runs: a test is reliable when it PASSED in every one."""
    candidates: int = 150
    """Most candidate bugs checked per project."""
    per_project: int = 40
    """Most tasks kept per project (checking stops there)."""
    max_fail_to_pass: int = 20
    """Most tests one bug may break (more: the bug is not a focused task)."""
    seed: int = 0
    """Which candidates are drawn, and in which order."""
    jobs: int = 2
    """Candidates checked at once (one test run each)."""
    timeout_factor: float = 6.0
    """A candidate's run is cut at this many times the baseline's (plus 30 s)."""
    full_suite_s: float = 120.0
    """A task runs the whole suite when the baseline run takes at most this many seconds,
    else the test files of its failing tests."""
    hold_back: bool = True
    """Hold back half of the failing test functions from the harness (see `holdback`)."""


@dataclass(slots=True)
class ProjectReport:
    project: str
    stage_seconds: dict[str, float] = field(default_factory=dict)
    reliable: int = 0
    flaky: int = 0
    baseline_seconds: float = 0.0
    mutations: int = 0
    """Candidate bugs the project's code has (before sampling)."""
    candidates: int = 0
    checked: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "project": self.project,
            "reliable_tests": self.reliable,
            "flaky_tests": self.flaky,
            "baseline_seconds": round(self.baseline_seconds, 2),
            "mutations": self.mutations,
            "candidates": self.candidates,
            "checked": self.checked,
            "kept": self.kept,
            "dropped": dict(sorted(self.dropped.items())),
            "stage_seconds": {k: round(v, 1) for k, v in self.stage_seconds.items()},
            **({"error": self.error} if self.error else {}),
        }


@dataclass(frozen=True, slots=True)
class Candidate:
    key: str
    """Stable id: a digest of the project, the seed and the mutation."""
    mutation: Mutation


def synthesize(
    projects: list[Project],
    out: Path,
    settings: SynthSettings,
    on_progress: Callable[[str, int, int], None] | None = None,
    prepared: Mapping[str, tuple[Path, Path]] | None = None,
) -> dict[str, Any]:
    """Every stage for every project; returns the report (also written to out/report.json)
    and writes out/tasks.jsonl. A project that fails a stage is reported with its error; the
    others go on. `prepared` maps a project's requirement to its (checkout, environment)
    when those exist already (a checkout made elsewhere, a prebuilt venv): fetch and
    environment are then skipped."""
    started = time.monotonic()
    out = out.resolve()  # the paths in the records are absolute, and commands run elsewhere
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for project in projects:
        report = ProjectReport(project.requirement)
        try:
            ready = (prepared or {}).get(project.requirement)
            _project(project, out, settings, report, on_progress, ready=ready)
        except (envs.EnvError, RuntimeError, OSError, subprocess.SubprocessError) as err:
            report.error = f"{type(err).__name__}: {err}"[-2000:]
        reports.append(report)
    records = _gather(out, projects)
    with (out / "tasks.jsonl.tmp").open("wb") as f:
        for record in records:
            f.write(orjson.dumps(record) + b"\n")
    (out / "tasks.jsonl.tmp").replace(out / "tasks.jsonl")
    dropped: Counter[str] = Counter()
    for report in reports:
        dropped.update(report.dropped)
    summary = {
        "tasks": len(records),
        "projects_with_tasks": len({r["project"] for r in records}),
        "candidates": sum(r.candidates for r in reports),
        "checked": sum(r.checked for r in reports),
        "kept": sum(r.kept for r in reports),
        "dropped": dict(sorted(dropped.items())),
        "errors": sum(1 for r in reports if r.error),
        "wall_seconds": round(time.monotonic() - started, 1),
        "settings": {name: getattr(settings, name) for name in SynthSettings.__dataclass_fields__},
        "projects": [r.as_json() for r in reports],
        "tasks_file": str(out / "tasks.jsonl"),
    }
    (out / "report.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


@dataclass(slots=True)
class _Job:
    """One project's check stage: what every candidate's check reads and updates."""

    project: Project
    pristine: Path
    env: Path
    out: Path
    settings: SynthSettings
    report: ProjectReport
    reliable: list[str]
    failing: list[str]
    """Tests that failed or errored in a baseline run (they may fail in a task's run)."""
    command: list[str]
    full_suite: bool
    timeout_s: float
    kept_sets: set[tuple[str, ...]]
    kept: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, candidate: Candidate, copy: Path) -> dict[str, Any]:
        """The candidate's result: {"status": "kept", "record": ...} or the drop reason
        ("skipped" once enough are kept: not recorded, so a larger run checks it)."""
        with self.lock:
            if self.kept >= self.settings.per_project:
                return {"status": "skipped"}
        mutation = candidate.mutation
        target = copy / mutation.path
        original = target.read_bytes()
        target.write_bytes(mutation.source.encode("utf-8"))
        try:
            run = envs.run_command(
                self.command, copy, self.timeout_s, self.project.requirement, [self.project.tests]
            )
        except envs.EnvError:  # the bug stops pytest itself (a conftest that cannot import)
            return {"status": "runner_broken"}
        finally:
            target.write_bytes(original)
        if run.timed_out:
            return {"status": "timeout"}
        if run.problems:  # the run does not add up under the guard: no task of it
            return {"status": "unguarded", "problems": list(run.problems)}
        broken = sorted(t for t in self.reliable if run.outcomes.get(t) != "PASSED")
        if not broken:
            return {"status": "no_failing_tests"}
        if len(broken) > self.settings.max_fail_to_pass:
            return {"status": "too_many_failing_tests", "broken": len(broken)}
        with self.lock:
            if tuple(broken) in self.kept_sets:
                return {"status": "duplicate_failing_tests"}
            if self.kept >= self.settings.per_project:
                return {"status": "skipped"}
            self.kept_sets.add(tuple(broken))
            self.kept += 1
        started = time.monotonic()
        record = self.task(candidate, broken, run)
        with self.lock:
            stages = self.report.stage_seconds
            stages["task"] = stages.get("task", 0.0) + time.monotonic() - started
        return {"status": "kept", "FAIL_TO_PASS": broken, "record": record}

    def task(self, candidate: Candidate, broken: list[str], run: envs.TestRun) -> dict[str, Any]:
        """The task's repository, and its SWE-bench-format record."""
        project, mutation = self.project, candidate.mutation
        instance_id = f"{project.name}-{project.version}__{mutation.kind}-{candidate.key[:10]}"
        original = (self.pristine / mutation.path).read_bytes().decode("utf-8")
        patch = unified_patch(mutation.path, mutation.source, original)
        held, visible, test_patch = self._held_back(candidate, broken)
        changes = {mutation.path: mutation.source, **visible}
        # Named by its content too: the same bug with other tests held back is another tree.
        tree = hashlib.sha256(orjson.dumps(changes, option=orjson.OPT_SORT_KEYS)).hexdigest()
        repo = self.out / "repos" / f"{instance_id}.{tree[:8]}.git"
        commit = task_repository(self.pristine, changes, repo)
        fix_lines = [
            line[1:]
            for line in patch.splitlines()
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        ]
        shown = [t for t in broken if function_of(t) not in held]
        failures = [Failure(test, _reported(run, test)) for test in shown]
        files = sorted({test.split("::", 1)[0] for test in broken})
        # The whole suite, or (as SWE-bench does) the test files of the failing tests.
        command = self.command if self.full_suite else [*self.command[:-1], *files]

        def scope(test: str) -> bool:
            return self.full_suite or test.split("::", 1)[0] in files

        broken_set = set(broken)
        return {
            "instance_id": instance_id,
            "repo": str(repo.resolve()),
            "base_commit": commit,
            "patch": patch,
            "test_patch": test_patch,
            "problem_statement": problem_statement(project.name, failures, fix_lines),
            "FAIL_TO_PASS": broken,
            "PASS_TO_PASS": [t for t in self.reliable if scope(t) and t not in broken_set],
            "known_failures": [t for t in self.failing if scope(t)],
            "held_back": held,
            "project": project.requirement,
            "environment": str(self.env.resolve()),
            "python_path": [envs.import_root(project)],
            "test_command": command,
            "tests_dir": project.tests,
            "mutation": {
                "path": mutation.path,
                "kind": mutation.kind,
                "line": mutation.line,
                "description": mutation.description,
            },
        }

    def _held_back(
        self, candidate: Candidate, broken: list[str]
    ) -> tuple[list[str], dict[str, str], str]:
        """(the test functions held back, the visible test files they were cut from, the
        test_patch that restores them)."""
        wanted = choose(broken, candidate.key) if self.settings.hold_back else []
        by_file: dict[str, list[str]] = {}
        for function in wanted:
            by_file.setdefault(function.split("::", 1)[0], []).append(function)
        held: list[str] = []
        visible: dict[str, str] = {}
        patches = []
        for path, functions in sorted(by_file.items()):
            full = (self.pristine / path).read_bytes().decode("utf-8")
            text, done = cut(full, functions)
            if done:
                held += done
                visible[path] = text
                patches.append(unified_patch(path, text, full))
        if len({function_of(t) for t in broken} - set(held)) == 0:
            return [], {}, ""  # never all of them: the harness must see the bug fail
        return sorted(held), visible, "".join(patches)


def _project(
    project: Project,
    out: Path,
    settings: SynthSettings,
    report: ProjectReport,
    on_progress: Callable[[str, int, int], None] | None,
    *,
    ready: tuple[Path, Path] | None,
) -> None:
    work = out / "work"
    name = f"{project.name}-{project.version}"
    clock = _Clock(report)
    if ready is not None:
        pristine, env = ready
    else:
        with clock("fetch"):
            pristine = checkout(project, work / "checkouts", work / "sdists")
        with clock("environment"):
            env = envs.environment(project, out / "envs")
    with clock("baseline"):
        baseline = measure(project, pristine, env, settings.runs, work / name)
    report.reliable, report.flaky = len(baseline.reliable), len(baseline.flaky)
    report.baseline_seconds = baseline.seconds
    with clock("candidates"):
        candidates, report.mutations = _candidates(project, pristine, settings)
    report.candidates = len(candidates)
    results_path = work / name / f"results-{settings.seed}.jsonl"
    # A timeout says as much about the machine (a loaded one) as about the candidate: a
    # rerun checks it again, the other verdicts stand.
    done = {k: r for k, r in _read_results(results_path).items() if r["status"] != "timeout"}
    kept = [r for r in done.values() if r["status"] == "kept"]
    job = _job(project, pristine, env, out, settings=settings, report=report, baseline=baseline)
    job.kept_sets = {tuple(r["FAIL_TO_PASS"]) for r in kept}
    job.kept = len(kept)
    for result in done.values():
        report.checked += 1
        _count(report, result["status"])
    todo = [c for c in candidates if c.key not in done]
    with clock("check"):
        _check_all(job, todo, work / name, results_path, on_progress)
    report.kept = job.kept
    if job.kept:
        deploy.write(project, out, env, _harness_dir())


def _job(
    project: Project,
    pristine: Path,
    env: Path,
    out: Path,
    *,
    settings: SynthSettings,
    report: ProjectReport,
    baseline: Baseline,
) -> _Job:
    return _Job(
        project,
        pristine,
        env,
        out,
        settings,
        report,
        baseline.reliable,
        sorted({*baseline.failing, *baseline.flaky}),
        envs.pytest_command(project, env),
        baseline.seconds <= settings.full_suite_s,
        settings.timeout_factor * baseline.seconds + 30.0,
        kept_sets=set(),
        kept=0,
    )


def synthesize_one(
    project: Project,
    pristine: Path,
    env: Path,
    out: Path,
    *,
    mutation: Mutation,
    settings: SynthSettings | None = None,
) -> dict[str, Any]:
    """One chosen bug through the stages `synthesize` takes a candidate through (baseline,
    check, task), in `out`: {"status": "kept", "record": ...} or why it was not kept."""
    settings = settings or SynthSettings()
    report = ProjectReport(project.requirement)
    name = f"{project.name}-{project.version}"
    baseline = measure(project, pristine, env, settings.runs, out / "work" / name)
    job = _job(
        project,
        pristine.resolve(),
        env,
        out.resolve(),
        settings=settings,
        report=report,
        baseline=baseline,
    )
    key = hashlib.sha256(
        f"{project.requirement}\0chosen\0{mutation.path}\0{mutation.line}\0"
        f"{mutation.description}".encode()
    ).hexdigest()[:16]
    copy = out / "work" / name / f"chosen-{key}"
    if copy.exists():
        shutil.rmtree(copy)
    export(pristine, copy)
    try:
        return job.check(Candidate(key, mutation), copy)
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def _harness_dir() -> Path | None:
    """examples/swe of a source checkout (the coding harness the images carry), if here."""
    here = Path(__file__).resolve().parents[2] / "examples" / "swe"
    return here if (here / "launch.py").is_file() else None


def _check_all(
    job: _Job,
    todo: list[Candidate],
    scratch: Path,
    results_path: Path,
    on_progress: Callable[[str, int, int], None] | None,
) -> None:
    if not todo:
        return
    jobs = max(1, min(job.settings.jobs, len(todo)))
    copies: queue.Queue[Path] = queue.Queue()
    for i in range(jobs):
        copy = scratch / f"copy-{i}"
        if copy.exists():
            shutil.rmtree(copy)
        export(job.pristine, copy)
        copies.put(copy)
    write_lock = threading.Lock()
    report = job.report
    total = report.checked + len(todo)

    def one(candidate: Candidate) -> None:
        copy = copies.get()
        try:
            result = job.check(candidate, copy)
        finally:
            copies.put(copy)
        if result["status"] == "skipped":
            return
        line = orjson.dumps({"key": candidate.key, **result}) + b"\n"
        with write_lock:
            with results_path.open("ab") as f:
                f.write(line)
            report.checked += 1
            _count(report, result["status"])
            if on_progress is not None:
                on_progress(report.project, report.checked, total)

    with ThreadPoolExecutor(jobs, thread_name_prefix="swe-check") as pool:
        for future in [pool.submit(one, c) for c in todo]:
            future.result()
    for i in range(jobs):
        shutil.rmtree(scratch / f"copy-{i}", ignore_errors=True)


def _count(report: ProjectReport, status: str) -> None:
    if status != "kept":
        report.dropped[status] += 1


def code_files(project: Project, repo: Path) -> list[str]:
    """The project's code modules (repository-relative, sorted): never test code."""
    root = repo / project.code
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    out = []
    for path in files:
        relative = path.relative_to(repo).as_posix()
        if not is_test_path(relative) and "/." not in f"/{relative}":
            out.append(relative)
    return out


def _candidates(
    project: Project, repo: Path, settings: SynthSettings
) -> tuple[list[Candidate], int]:
    """A seeded sample of the project's mutations (at most settings.candidates), in the
    seeded order, and how many there were."""
    heap: list[tuple[str, int, Candidate]] = []  # max-heap by key: (negated key, n, cand)
    count = 0
    for path in code_files(project, repo):
        try:
            source = (repo / path).read_bytes().decode("utf-8")  # newlines as they are
            for candidate in _keyed(project, settings.seed, path, source):
                count += 1
                item = (_negated(candidate.key), count, candidate)
                if len(heap) < settings.candidates:
                    heapq.heappush(heap, item)
                elif item[0] > heap[0][0]:
                    heapq.heapreplace(heap, item)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # not Python 3 source: no candidates from it
    ordered = sorted((c for _, _, c in heap), key=lambda c: c.key)
    return ordered, count


def _keyed(project: Project, seed: int, path: str, source: str) -> Iterator[Candidate]:
    seen: Counter[tuple[int, str]] = Counter()
    for mutation in mutations(path, source):
        what = f"{project.requirement}\0{seed}\0{path}\0{mutation.line}\0{mutation.description}"
        # two edits of one line can read alike (`1` -> `2` twice): the later ones numbered
        nth = seen[mutation.line, mutation.description]
        seen[mutation.line, mutation.description] += 1
        key = hashlib.sha256(f"{what}\0{nth}".encode() if nth else what.encode()).hexdigest()
        yield Candidate(key[:16], mutation)


def _negated(key: str) -> str:
    """A string that sorts in the reverse order of the hex `key` (for a max-heap)."""
    return "".join("0123456789abcdef"[15 - int(c, 16)] for c in key)


def _read_results(path: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return results
    for raw in path.read_bytes().splitlines():
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError:
            continue  # a line cut by a kill: that candidate is checked again
        if isinstance(item, dict) and isinstance(item.get("key"), str):
            results[item["key"]] = item
    return results


def _reported(run: envs.TestRun, test: str) -> str:
    """What the run says of a test that no longer passes."""
    outcome = run.outcomes.get(test)
    if outcome is None:
        return "E   pytest no longer collects this test (it is not in the run at all)"
    return run.failures.get(test) or f"E   reported {outcome}"


def _gather(out: Path, projects: list[Project]) -> list[dict[str, Any]]:
    """Every kept task's record, by project then candidate key."""
    records = []
    for project in projects:
        directory = out / "work" / f"{project.name}-{project.version}"
        for path in sorted(directory.glob("results-*.jsonl")):
            results = _read_results(path)
            for key in sorted(results):
                record = results[key].get("record")
                if results[key]["status"] == "kept" and isinstance(record, dict):
                    records.append(record)
    seen: set[str] = set()
    unique = []
    for record in records:
        if record["instance_id"] not in seen:
            seen.add(record["instance_id"])
            unique.append(record)
    return unique


class _Clock:
    """Adds each stage's wall time to the report."""

    def __init__(self, report: ProjectReport) -> None:
        self._report = report

    def __call__(self, stage: str) -> _Timed:
        return _Timed(self._report, stage)


class _Timed:
    def __init__(self, report: ProjectReport, stage: str) -> None:
        self._report, self._stage = report, stage

    def __enter__(self) -> None:
        self._started = time.monotonic()

    def __exit__(self, *_: object) -> None:
        seconds = time.monotonic() - self._started
        self._report.stage_seconds[self._stage] = (
            self._report.stage_seconds.get(self._stage, 0.0) + seconds
        )
