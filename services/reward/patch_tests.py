"""The built-in `tests` reward: apply the harness's patch, run the task's tests, score them.

For each episode: the task's repository is cloned at its base commit into a fresh directory
(deleted afterwards, whatever happens), the harness's patch is applied, and the task's test
command runs there, contained (see `sandbox`). The score is graded from what the runner
reports (see `grading`; only a test the runner reports PASSED passes). The run scores the
patch's code against a pristine copy of the tests and of everything that decides how they
run:

1. Refused (score 0, nothing is run, a flag per kind; see `patch_rules`): a patch that
   changes a test file, a conftest.py, pytest's configuration, `.gitattributes`, what
   Python or pytest import before or around the tests (sitecustomize, .pth, a module
   shadowing the runner or the standard library, a plugin module, package metadata
   declaring a plugin, code reaching into the runner), compiled code, or a symbolic link.
   A fix may change the rest of pyproject.toml, setup.cfg and tox.ini.
2. Restored from the commit before the run: the task's protected paths (the rule above
   already refuses any change there; this is defence in depth), caches (.pytest_cache) and
   package metadata a harness left behind.
3. Run with an environment the repository cannot influence (`sandbox.clean_env`: none of
   the caller's variables, no user site-packages) plus, for pytest, PYTEST_ADDOPTS
   `-p no:cacheprovider -rA` (no cache read from the copy; the short summary that
   confirms the JUnit report) and PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 unless the task sets
   `plugin_autoload`. pytest then reads the commit's configuration, content for content
   (rule 1), so its rootdir and ini file are the commit's and the node ids the task names
   stay as they were; the reward does not pin `-c`/`--rootdir` or clear `addopts`, which
   are the task's own choice in its command. A task command that sets PYTEST_ADDOPTS
   itself replaces this one.

Flags: empty_patch (nothing is run), patch_failed (git could not apply it: paths out of the
repository or into .git included), the refusal flags of `patch_rules`, and the run's flags
of `grading` (timeout, early_exit, report_invalid, tests_skipped, tests_xfailed,
tests_xpassed, tests_missing).

What no check here reaches: code the patch puts in the package runs inside the test process
when the tests import it, and such code can rewrite the runner's reports in memory. The
code scan of `patch_rules` refuses the plain forms, the run's checks catch the effects of
the common ones (skips, xfail marks, an early exit, a forged report without the summary
lines); a determined rewrite of pytest's internals from obfuscated package code is not
detected.

The metadata fields are described in `coding_task`. Infrastructure problems (git missing,
a clone timing out, no network namespace where one is required) raise: the reward is then
missing, not 0.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harnessrl.logs import get_logger
from harnessrl.services.reward.coding_task import CodingTask
from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.episode import Episode, Score
from harnessrl.services.reward.grading import grade, listed
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
from harnessrl.services.reward.run_report import RunReport, SummaryScanner, read_report
from harnessrl.services.reward.sandbox import NetworkPolicy, RunOutcome, clean_env, run_group

log = get_logger(__name__)

PYTEST_ADDOPTS = "-p no:cacheprovider -rA"
"""Given to every run's pytest: no cache read from (or written to) the copy; the short
summary of every outcome, which confirms the JUnit report."""
_REGULAR = ("100644", "100755")
"""git modes of regular files (not links, not submodules)."""


class TestsReward:
    """builtin:tests; see the module docstring. One instance scores any number of episodes
    concurrently (each in its own copy)."""

    def __init__(self, settings: TestsSettings) -> None:
        self._settings = settings
        self._network = NetworkPolicy(settings.network)

    async def __call__(self, episode: Episode) -> Score:
        """Score the episode's patch. Raises ValueError naming the metadata field when the
        task is ill-described, RuntimeError or TimeoutError when scoring itself failed."""
        task = CodingTask.from_metadata(episode.task_metadata, self._settings)
        patch = read_patch(episode, self._settings)
        if not patch.strip():
            return Score(0.0, flags=("empty_patch",), message="the harness produced no patch")
        prefix = await self._network.prefix()
        scratch = self._settings.scratch_dir
        if scratch is not None:
            scratch.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix="harnessrl-tests-", dir=scratch))
        try:
            return await self._score(task, patch, workdir, prefix)
        finally:
            await asyncio.to_thread(_remove, workdir)

    async def _score(
        self, task: CodingTask, patch: str, workdir: Path, prefix: tuple[str, ...]
    ) -> Score:
        copy = workdir / "repo"
        await clone_at(task.repo, task.base_commit, copy)
        base = await tracked(copy)
        view = await _pristine(copy, base, task)
        patch_path = workdir / "patch.diff"
        text = patch if patch.endswith("\n") else patch + "\n"  # git needs the last newline
        patch_path.write_bytes(text.encode("utf-8", "surrogateescape"))
        error = await apply_patch(copy, patch_path)
        if error is not None:
            return Score(0.0, flags=("patch_failed",), message=f"git apply: {error}")
        changed = await changes(copy)
        refused = await _refusals(copy, base, changed, view)
        if refused:
            return _refused(refused)
        await restore(copy, task.protected_paths)  # defence in depth: the rules above hold
        await restore(copy, leftovers(changed, view))
        if task.test_patch.strip():
            tests_path = workdir / "test_patch.diff"
            tests = task.test_patch if task.test_patch.endswith("\n") else task.test_patch + "\n"
            tests_path.write_bytes(tests.encode("utf-8", "surrogateescape"))
            failed = await apply_patch(copy, tests_path)
            if failed is not None:  # the task's own tests do not apply to its commit
                raise ValueError(f"task metadata.test_patch: does not apply: {failed}")
        outcome, report = await self._run(task, workdir, copy, prefix)
        return grade(task, outcome, report)

    async def _run(
        self, task: CodingTask, workdir: Path, copy: Path, prefix: tuple[str, ...]
    ) -> tuple[RunOutcome, RunReport]:
        home, tmp, reports = workdir / "home", workdir / "tmp", workdir / "reports"
        for directory in (home, tmp, reports):
            directory.mkdir()
        junit_xml = reports / "junit.xml"
        summary = SummaryScanner()
        command = task.command_with(str(junit_xml))
        env = clean_env(home, tmp) | runner_env(task)
        # Checked here, not left to exec: under unshare a missing program is exit code 127.
        if "/" not in command[0] and shutil.which(command[0], path=env["PATH"]) is None:
            raise ValueError(f"task metadata.test_command[0]: {command[0]!r} is not on PATH")
        try:
            outcome = await run_group(
                (*prefix, *command),
                cwd=copy,
                env=env,
                timeout_s=task.timeout_s,
                kill_grace_s=self._settings.kill_grace_s,
                output_cap_bytes=self._settings.output_cap_bytes,
                on_line=summary.feed,
            )
        except OSError as err:
            raise ValueError(f"task metadata.test_command: cannot start it: {err}") from err
        return outcome, read_report(junit_xml, summary)


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
    env = {"PYTEST_ADDOPTS": PYTEST_ADDOPTS}
    if not task.plugin_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


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
