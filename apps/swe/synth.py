"""`swe synth`: real coding tasks made from pinned open-source projects by injecting bugs
(SWE-smith's procedure, without an LLM).

For each project, in stages, each of which a rerun skips when its result is on disk:

1. fetch: the pinned sdist as a git repository (`fetch.checkout`);
2. environment: a venv with pytest and the test requirements, never the project
   (`env.environment`);
3. baseline: the suite run `runs` times; a test is reliable when it PASSED every time, flaky
   when it passed only some of the time (flaky tests are in no task);
4. candidates: AST mutations of the project's code, never its tests (`mutate.mutations`), a
   seeded sample of at most `candidates` per project, in a seeded order (candidates.py);
5. check (bug_check.py): each candidate runs the whole suite once; FAIL_TO_PASS is the
   reliable tests that no longer pass: every test the bug makes fail anywhere in the suite.
   Kept when 1 <= |FAIL_TO_PASS| <= `max_fail_to_pass` (so every other reliable test still
   passes) and no kept task of the project has the same FAIL_TO_PASS; at most `per_project`
   are kept (a bug that stops pytest itself, a conftest that no longer imports, is dropped
   as `runner_broken`; one whose run does not add up under the guard as `unguarded`). The
   task's command runs the whole suite when its baseline run takes at most `full_suite_s`,
   else (as in SWE-bench) the test files of its FAIL_TO_PASS; PASS_TO_PASS is every other
   reliable test the command runs, and `known_failures` the tests it runs that failed in a
   baseline run (the only tests besides the named ones allowed to fail: builtin:tests scores
   0 a patch that makes any other test fail, named or not);
6. task (task_record.py): a repository of one commit holding the buggy tree and nothing else
   (no history, no pristine file, not even as an unreachable object), the gold patch (the
   fix, as a `git diff` would write it), and a problem statement written from what fails.
   When the bug breaks several test functions, half of them are held back (`holdback`): cut
   from the repository's test files, restored by the task's `test_patch` in the reward's
   copy only, and left out of the problem statement.

Output, under `out`:

    tasks.jsonl            SWE-bench-format records (see tasks.py), with the project, its
                           environment and the test command `clean --validate` and
                           builtin:tests run (`project`, `environment`, `test_command`)
    report.json            counts per stage and drop reasons, wall time per stage
                           (synth_report.py)
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
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson

from harnessrl.apps.swe import deploy
from harnessrl.apps.swe import env as envs
from harnessrl.apps.swe.baseline import Baseline, measure
from harnessrl.apps.swe.bug_check import BugCheck, check_all, read_results
from harnessrl.apps.swe.candidates import Candidate, sample
from harnessrl.apps.swe.fetch import checkout
from harnessrl.apps.swe.mutate import Mutation
from harnessrl.apps.swe.projects import Project
from harnessrl.apps.swe.repository import export
from harnessrl.apps.swe.synth_report import ProjectReport, StageClock, count, run_summary
from harnessrl.apps.swe.synth_settings import SynthSettings
from harnessrl.apps.swe.task_record import TaskSource

STAGES = ("fetch", "environment", "baseline", "candidates", "check", "task")


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
    summary = run_summary(reports, records, settings, out, time.monotonic() - started)
    (out / "report.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return summary


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
    clock = StageClock(report)
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
        candidates, report.mutations = sample(project, pristine, settings.seed, settings.candidates)
    report.candidates = len(candidates)
    results_path = work / name / f"results-{settings.seed}.jsonl"
    # A timeout says as much about the machine (a loaded one) as about the candidate: a
    # rerun checks it again, the other verdicts stand.
    done = {k: r for k, r in read_results(results_path).items() if r["status"] != "timeout"}
    kept = [r for r in done.values() if r["status"] == "kept"]
    job = _bug_check(
        project, pristine, env, out, settings=settings, report=report, baseline=baseline
    )
    job.kept_sets = {tuple(r["FAIL_TO_PASS"]) for r in kept}
    job.kept = len(kept)
    for result in done.values():
        report.checked += 1
        count(report, result["status"])
    todo = [c for c in candidates if c.key not in done]
    with clock("check"):
        check_all(job, todo, work / name, results_path, on_progress)
    report.kept = job.kept
    if job.kept:
        deploy.write(project, out, env, _harness_dir())


def _bug_check(
    project: Project,
    pristine: Path,
    env: Path,
    out: Path,
    *,
    settings: SynthSettings,
    report: ProjectReport,
    baseline: Baseline,
) -> BugCheck:
    source = TaskSource(
        project,
        pristine,
        env,
        out,
        baseline.reliable,
        sorted({*baseline.failing, *baseline.flaky}),
        envs.pytest_command(project, env),
        baseline.seconds <= settings.full_suite_s,
        settings.hold_back,
    )
    timeout_s = settings.timeout_factor * baseline.seconds + 30.0
    return BugCheck(source, settings, report, timeout_s, kept_sets=set(), kept=0)


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
    job = _bug_check(
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


def _gather(out: Path, projects: list[Project]) -> list[dict[str, Any]]:
    """Every kept task's record, by project then candidate key."""
    records = []
    for project in projects:
        directory = out / "work" / f"{project.name}-{project.version}"
        for path in sorted(directory.glob("results-*.jsonl")):
            results = read_results(path)
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
