"""A pinned project's test environment and baseline (harnessrl.apps.swe.env) on a real sdist:
the suite passes from the working copy, the environment holds no copy of the project, and
a bug injected in the copy shows as failing tests with the runner's text."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from harnessrl.apps.swe.env import environment, reliable_passes, run_tests
from harnessrl.apps.swe.fetch import checkout
from harnessrl.apps.swe.mutate import mutations
from tests.six import SixReady

pytestmark = pytest.mark.integration


def test_six_passes_reliably_from_its_copy_and_a_bug_shows(
    tmp_path: Path, six_ready: SixReady
) -> None:
    six = six_ready.project
    repo = tmp_path / "six"  # a copy: the session's checkout stays pristine
    shutil.copytree(six_ready.checkout, repo, symlinks=True)
    env = six_ready.env
    assert environment(six, six_ready.root / "envs") == env  # built once
    assert checkout(six, six_ready.root / "work" / "checkouts") == six_ready.checkout
    # No pristine copy in the environment: six imports only from the working copy.
    bare = subprocess.run(
        [env / "bin" / "python", "-c", "import six"], capture_output=True, check=False
    )
    assert bare.returncode != 0
    passing, runs = reliable_passes(six, repo, env, runs=2)
    assert len(passing) > 100 and len(runs) == 2
    assert all(outcome in ("PASSED", "SKIPPED", "XFAIL") for outcome in runs[0].outcomes.values())
    source = (repo / "six.py").read_text()
    lines = source.splitlines()
    # PY2 = sys.version_info[0] == 2  ->  != 2: six believes it runs on Python 2
    bug = next(
        m
        for m in mutations("six.py", source)
        if m.kind == "compare" and lines[m.line - 1].startswith("PY2 = ")
    )
    (repo / "six.py").write_text(bug.source)
    broken = run_tests(six, repo, env)
    failed = {t for t, outcome in broken.outcomes.items() if outcome in ("FAILED", "ERROR")}
    assert failed and failed <= passing | set(broken.outcomes)
    assert all(broken.failures.get(t) for t in failed if broken.outcomes[t] == "FAILED")
