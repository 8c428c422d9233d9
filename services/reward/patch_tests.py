"""The built-in `tests` reward: apply the harness's patch, run the task's tests jailed, score
what the test guard proves.

For each episode: the task's repository is cloned at its base commit into a fresh directory
(deleted afterwards, whatever happens), the harness's patch is applied, and the task's test
command runs there in a jail (`jail`: its own PID and network namespaces, everything
read-only but a private /tmp, nothing of the machine in view but the system, the task's
Python environment and the copy). The score is graded from the test guard's authenticated
report (`evidence`, `grading`), never from a file or a line the run wrote. The run scores
the patch's code against a pristine copy of the tests and of everything that decides how
they run:

1. Refused (score 0, nothing is run, a flag per kind; see `patch_rules`): a patch that
   changes a test file, a conftest.py, pytest's configuration, `.gitattributes`, what
   Python or pytest import before or around the tests (sitecustomize, .pth, a module
   shadowing the runner or the standard library, a plugin module, package metadata
   declaring a plugin, code reaching into the runner), compiled code, or a symbolic link.
   A fix may change the rest of pyproject.toml, setup.cfg and tox.ini.
2. Restored from the commit before the run: the task's protected paths (the rule above
   already refuses any change there; this is defence in depth), caches (.pytest_cache) and
   package metadata a harness left behind. Then the task's `test_patch` (tests held back
   from the harness) is applied.
3. Run jailed with an environment the repository cannot influence (`sandbox.clean_env`:
   none of the caller's variables, no user site-packages) plus, for pytest, PYTEST_ADDOPTS
   `-p harnessrl_testguard -p no:cacheprovider` (the guard first; no cache) and
   PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 unless the task sets `plugin_autoload`. pytest then
   reads the commit's configuration, content for content (rule 1). A task command that sets
   PYTEST_ADDOPTS itself replaces this one, and every run of it is then `guard_missing`.

Flags: empty_patch (nothing is run), patch_failed (git could not apply it: paths out of the
repository or into .git included), the refusal flags of `patch_rules`, and the run's flags
of `grading`.

What the guard cannot see: code of the patch runs in the test process when the tests
import it, and code that rewrites the guard itself in memory, or that computes the tested
values differently because it detects the test runner, is not caught by the run alone;
held-back tests (`test_patch`) and the regression rule (`known_failures`) are what stand
against the second.

The metadata fields are described in `coding_task`. Infrastructure problems (git missing,
a clone timing out, a jail that cannot be set up) raise: the reward is then missing, not 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.logs import get_logger
from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.episode import Episode, Score
from harnessrl.services.reward.evidence import Evidence, read
from harnessrl.services.reward.grading import grade, listed
from harnessrl.services.reward.group_run import RunOutcome, clean_env
from harnessrl.services.reward.hidden_cases import (
    HiddenCases,
    interpreter,
    mismatch,
    mismatches,
    parse,
    runner_argv,
)
from harnessrl.services.reward.jail import (
    GUARD_MODULE,
    JAIL_TMP,
    GuardView,
    Jail,
    JailedRun,
    python_prefixes,
)
from harnessrl.services.reward.patch_rules import (
    Pristine,
    Refusal,
    leftovers,
    needs_contents,
    pristine,
    refusals,
)
from harnessrl.services.reward.pytest_config import (
    CONFIG_NAMES,
    plugins_in_conftest,
    plugins_in_settings,
    settings_of,
)
from harnessrl.services.reward.repo_copy import (
    Change,
    TrackedFile,
    apply_patch,
    blobs,
    changes,
    clone_at,
    restore,
    tracked,
)

log = get_logger(__name__)

PYTEST_ADDOPTS = f"-p {GUARD_MODULE} -p no:cacheprovider"
"""Given to every run's pytest: the guard, loaded first; no cache read from the copy."""
JUNIT_IN_JAIL = f"{JAIL_TMP}/harnessrl-junit.xml"
"""Where a command's `{junit_xml}` points: inside the jail, discarded (nothing reads it)."""
_REGULAR = ("100644", "100755")
"""git modes of regular files (not links, not submodules)."""


class TestsReward:
    """builtin:tests; see the module docstring. One instance scores any number of episodes
    concurrently (each in its own copy and jail)."""

    def __init__(self, settings: TestsSettings) -> None:
        self._settings = settings
        self._jail = Jail(settings)

    async def __call__(self, episode: Episode) -> Score:
        """Score the episode's patch. Raises ValueError naming the metadata field when the
        task is ill-described, RuntimeError (JailError included) or TimeoutError when
        scoring itself failed."""
        task = CodingTask.from_metadata(episode.task_metadata, self._settings)
        patch = read_patch(episode, self._settings)
        if not patch.strip():
            return Score(0.0, flags=("empty_patch",), message="the harness produced no patch")
        async with self.copy(task) as copy:
            return await self._score(task, patch, copy)

    @contextlib.asynccontextmanager
    async def copy(self, task: CodingTask) -> AsyncIterator[Copy]:
        """A private clone of the task's repository at its base commit, with the commit's
        view of its tests; deleted on exit, whatever happens."""
        scratch = self._settings.scratch_dir
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="harnessrl-tests-", dir=scratch))
        try:
            repo = workdir / "repo"
            await clone_at(task.repo, task.base_commit, repo)
            base = await tracked(repo)
            yield Copy(workdir, repo, base, await _pristine(repo, base, task))
        finally:
            await asyncio.to_thread(_remove, workdir)

    async def _score(self, task: CodingTask, patch: str, copy: Copy) -> Score:
        error = await apply_patch(copy.repo, _write(copy.workdir / "patch.diff", patch))
        if error is not None:
            return Score(0.0, flags=("patch_failed",), message=f"git apply: {error}")
        changed = await changes(copy.repo)
        refused = await _refusals(copy.repo, copy.base, changed, copy.view)
        if refused:
            return _refused(refused)
        await restore(copy.repo, task.protected_paths)  # defence in depth: the rules above hold
        await restore(copy.repo, leftovers(changed, copy.view))
        outcome, evidence = await self.run(task, copy)
        score = grade(task, outcome, evidence, [c.path for c in changed])
        if task.hidden_cases is None or score.value == 0.0:
            return score
        return await self._judge_cases(task, task.hidden_cases, copy, score)

    async def _judge_cases(
        self, task: CodingTask, cases: HiddenCases, copy: Copy, score: Score
    ) -> Score:
        """The tests' score when the patched code reproduces every hidden case, else 0."""
        jailed = await self.run_cases(task, cases, copy)
        answers = await asyncio.to_thread(parse, jailed.channel)
        found = mismatches(cases, answers)
        if jailed.outcome.timed_out:
            found.insert(0, f"killed after {self._settings.cases_timeout_s:g} s")
        if jailed.overflowed:
            found.insert(0, "more written into the channel than is read")
        total = len(cases.cases)
        matched = sum(1 for case in cases.cases if mismatch(case, answers) is None)
        components = dict(score.components)
        components |= {"hidden_cases": float(total), "hidden_cases_matched": float(matched)}
        if not found:
            return Score(score.value, components, score.flags, score.message)
        flags = ("channel_overflow",) if jailed.overflowed else ()
        return Score(
            0.0,
            components,
            (*score.flags, *flags, "hidden_cases_failed"),
            "the tests passed, but the patched code does not compute what the fix computes: "
            f"{matched} of {total} hidden cases match ({listed(found)})",
        )

    async def run_cases(self, task: CodingTask, cases: HiddenCases, copy: Copy) -> JailedRun:
        """The hidden cases' calls run on the copy as it is, in a fresh interpreter in the
        jail that gets their inputs only (caserunner.py)."""
        env = clean_env(Path(JAIL_TMP), Path(JAIL_TMP)) | {"PYTHONHASHSEED": "0"}
        python = interpreter(task.command_words(), task.environment, env["PATH"])
        return await self.run_in_jail(task, copy, python, cases.runner_input(), env)

    async def run_in_jail(
        self, task: CodingTask, copy: Copy, python: str, stdin: bytes, env: dict[str, str]
    ) -> JailedRun:
        """The case runner on `python` (the task's) in the copy, jailed, with `stdin` as
        its input and the channel open; `reward.tests.cases_timeout_s` at most."""
        prefixes = python_prefixes([python], env["PATH"])
        if task.environment is not None:
            prefixes.append(Path(task.environment))
        try:
            return await self._jail.run(
                runner_argv(python),
                repo=copy.repo,
                prefixes=prefixes,
                env=env,
                guard=None,
                timeout_s=self._settings.cases_timeout_s,
                stdin=stdin,
            )
        except OSError as err:
            raise RuntimeError(f"reward.tests.bwrap: cannot start the jail: {err}") from err

    async def run(self, task: CodingTask, copy: Copy) -> tuple[RunOutcome, Evidence | None]:
        """The task's `test_patch` applied to the copy, then its test command run jailed:
        how the run ended, and the guard's evidence (None for the runner "command")."""
        if task.test_patch.strip():
            failed = await apply_patch(
                copy.repo, _write(copy.workdir / "tests.diff", task.test_patch)
            )
            if failed is not None:  # the task's own tests do not apply to its commit
                raise ValueError(f"task metadata.test_patch: does not apply: {failed}")
        env = clean_env(Path(JAIL_TMP), Path(JAIL_TMP)) | runner_env(task)
        command = task.command_with(JUNIT_IN_JAIL)
        # Checked here, not left to exec: inside the jail a missing program is exit code 127.
        if "/" not in command[0] and shutil.which(command[0], path=env["PATH"]) is None:
            raise ValueError(f"task metadata.test_command[0]: {command[0]!r} is not on PATH")
        prefixes = python_prefixes(task.command_words(), env["PATH"])
        if task.environment is not None:
            prefixes.append(Path(task.environment))
        guard = None
        if task.runner == "pytest":
            if not prefixes:
                raise ValueError(
                    "task metadata.test_command: no Python environment found in it to load "
                    "the test guard into (name it in metadata.environment)"
                )
            guard = GuardView(
                (*task.protected_paths, *copy.view.named), tuple(sorted(copy.view.plugin_files))
            )
        try:
            jailed = await self._jail.run(
                command,
                repo=copy.repo,
                prefixes=prefixes,
                env=env,
                guard=guard,
                timeout_s=task.timeout_s,
            )
        except OSError as err:
            raise RuntimeError(f"reward.tests.bwrap: cannot start the jail: {err}") from err
        evidence = None
        if guard is not None:  # parsed off the event loop: the channel may hold megabytes
            evidence = await asyncio.to_thread(read, jailed.channel, jailed.key, jailed.overflowed)
        return jailed.outcome, evidence


@dataclass(frozen=True, slots=True)
class Copy:
    """A task repository's private copy (see `TestsReward.copy`)."""

    workdir: Path
    repo: Path
    base: dict[str, TrackedFile]
    """The commit's files."""
    view: Pristine


def read_patch(episode: Episode, settings: TestsSettings) -> str:
    """The harness's patch: the artifacts' patch file when there is one, else the result's
    patch key when it holds a string, else ""."""
    if episode.artifacts_dir is not None:
        path = episode.artifacts_dir / settings.patch_file
        if path.is_file():
            return path.read_text("utf-8", errors="surrogateescape")
    result: Any = episode.result
    if isinstance(result, dict) and isinstance(result.get(settings.patch_key), str):
        return str(result[settings.patch_key])
    return ""


def runner_env(task: CodingTask) -> dict[str, str]:
    """The variables that pin how pytest runs (see the module docstring)."""
    env = {"PYTEST_ADDOPTS": PYTEST_ADDOPTS} if task.runner == "pytest" else {}
    if not task.plugin_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def _write(path: Path, patch: str) -> Path:
    text = patch if patch.endswith("\n") else patch + "\n"  # git needs the last newline
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    return path


async def _pristine(copy: Path, base: dict[str, TrackedFile], task: CodingTask) -> Pristine:
    """The commit's view of its tests; its conftests and configuration read for the plugin
    modules they load."""
    configs = {
        path: file
        for path, file in base.items()
        if file.mode in _REGULAR and Path(path).name in (*CONFIG_NAMES, "conftest.py")
    }
    data = await blobs(copy, (file.blob for file in configs.values()))
    modules: set[str] = set()
    for path, file in configs.items():
        if Path(path).name == "conftest.py":
            modules |= plugins_in_conftest(data[file.blob])
        elif (settings := settings_of(path, data[file.blob])) is not None:
            modules |= plugins_in_settings(settings)
    return pristine(base, task.protected_paths, task.command_words(), modules)


async def _refusals(
    copy: Path, base: dict[str, TrackedFile], changed: list[Change], view: Pristine
) -> list[Refusal]:
    """`patch_rules.refusals` of the patched copy: both sides of what they read, the
    commit's side from its objects."""
    links = await asyncio.to_thread(_links, copy, changed)
    wanted = [c for c in changed if needs_contents(c)]
    ids = {
        c.path: base[c.path].blob
        for c in wanted
        if c.path in base and base[c.path].mode in _REGULAR
    }
    old = await blobs(copy, ids.values())
    contents = {}
    for change in wanted:
        before = old[ids[change.path]] if change.path in ids else None
        after = None
        if change.kind != "deleted" and change.path not in links:
            after = await asyncio.to_thread(_read, copy / change.path)
        contents[change.path] = (before, after)
    return refusals(changed, links, contents, view)


def _links(copy: Path, changed: list[Change]) -> set[str]:
    return {c.path for c in changed if c.kind != "deleted" and (copy / c.path).is_symlink()}


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def _refused(found: list[Refusal]) -> Score:
    flags = tuple(sorted({r.flag for r in found}))
    shown = [f"{r.path}: {r.why} ({r.flag})" for r in found]
    return Score(
        0.0,
        components={"refused_paths": float(len(found))},
        flags=flags,
        message=f"the patch changes what decides how the tests run: {listed(shown)}",
    )


def _remove(path: Path) -> None:
    """Delete the episode's directory, also where the tests made parts of it read-only
    (a Go module cache, say)."""
    try:
        _remove_tree(str(path))
    except OSError as err:  # a process that escaped its group may still be writing there
        log.warning("could not delete a test run's directory", path=str(path), error=str(err))


def _remove_tree(path: str) -> None:
    def unlock(_: Callable[..., Any], failed: str, __: Any) -> None:
        parent = os.path.dirname(failed)
        os.chmod(parent, os.stat(parent).st_mode | stat.S_IRWXU)
        if os.path.isdir(failed) and not os.path.islink(failed):
            os.chmod(failed, os.stat(failed).st_mode | stat.S_IRWXU)
            _remove_tree(failed)
        else:
            os.unlink(failed)

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=unlock)
    else:
        shutil.rmtree(path, onerror=unlock)
