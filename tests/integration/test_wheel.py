"""The wheel, built from the tracked files and installed in a fresh venv with its declared
dependencies, works away from the repository: `harnessrl --help` and the help of every
subcommand, and every module of every service and application imports from the installed
copy.

The fresh venv gets requirements/runtime.lock (what pyproject.toml declares, locked, without
the dev extra), then the wheel with pip resolving its dependencies against what is installed
and no index to reach: a package the code imports but the wheel does not declare is missing
there, and the imports fail (the SDKs the chaos and load commands use were once found only
in the test environment).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.typecheck import ROOT, RUNS_ELSEWHERE, package_folders

pytestmark = pytest.mark.integration


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        argv, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    tracked = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT)
    tracked = tracked.split("\0")
    for name in tracked:
        if name and (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = base / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(dist),
            str(source),
        ],
        base,
    )
    wheels = list(dist.glob("harnessrl-*.whl"))
    assert len(wheels) == 1, wheels
    env_dir = base / "venv"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet"]
    lock = ROOT / "requirements" / "runtime.lock"
    _run([*pip, "--require-hashes", "--only-binary=:all:", "-r", str(lock)], base)
    _run([*pip, "--no-index", str(wheels[0])], base)  # its dependencies: installed or fail
    _run([sys.executable, "-m", "pip", "--python", python, "check"], base)
    return env_dir


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if ".venv" not in p
    )
    return env


def test_the_installed_command_runs_away_from_the_checkout(installed: Path, tmp_path: Path) -> None:
    harnessrl = str(installed / "bin" / "harnessrl")
    assert "usage: harnessrl" in _run([harnessrl, "--help"], tmp_path, _env())
    assert "--config" in _run([harnessrl, "up", "--help"], tmp_path, _env())
    where = _run(
        [str(installed / "bin" / "python"), "-c", "import harnessrl; print(harnessrl.__file__)"],
        tmp_path,
        _env(),
    )
    assert where.startswith(str(installed)), where


def test_every_module_imports_from_the_installed_copy(installed: Path, tmp_path: Path) -> None:
    modules = []
    for package, folder in package_folders().items():
        for path in sorted(folder.glob("*.py")):
            if path.stem == "__main__":
                continue  # running it is the program, not an import
            if str(path.relative_to(ROOT)) in RUNS_ELSEWHERE:
                continue  # copied into another interpreter, never imported here
            if path.stem != "__init__":
                modules.append(f"{package}.{path.stem}")
            else:
                modules.append(package)
    script = tmp_path / "imports.py"
    script.write_text(
        "import importlib, sys\n"
        f"names = {modules!r}\n"
        "bad = []\n"
        "for name in names:\n"
        "    where = str(importlib.import_module(name).__file__)\n"
        f"    if not where.startswith({str(installed)!r}): bad.append(name + ' ' + where)\n"
        "print(len(names), 'modules')\n"
        "sys.exit('outside the venv: ' + repr(bad) if bad else 0)\n"
    )
    out = _run([str(installed / "bin" / "python"), str(script)], tmp_path, _env())
    assert out.strip() == f"{len(modules)} modules"
    assert any(m.startswith("harnessrl.services.gateway.") for m in modules)
    assert any(m.startswith("harnessrl.apps.swe.") for m in modules)


HELP_EVERY_COMMAND = """
import argparse, contextlib, io, sys
from harnessrl.apps.cli import build_parser, main

def paths(parser, prefix):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from paths(sub, [*prefix, name])

failed = []
for path in paths(build_parser(), []):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*path, "--help"])
            code = None
        except SystemExit as exit:
            code = exit.code
    ok = code in (0, None) and out.getvalue().startswith("usage: harnessrl")
    print("ok  " if ok else "FAIL", " ".join(["harnessrl", *path, "--help"]))
    failed += [] if ok else [path]
sys.exit(1 if failed else 0)
"""


def test_every_subcommand_shows_its_help(installed: Path, tmp_path: Path) -> None:
    script = tmp_path / "help.py"
    script.write_text(HELP_EVERY_COMMAND)
    out = _run([str(installed / "bin" / "python"), str(script)], tmp_path, _env())
    print(out)  # the list, with `pytest -s`
    shown = out.splitlines()
    assert all(line.startswith("ok   harnessrl") for line in shown), out
    for command in (
        "gateway",
        "chaos",
        "bench load",
        "swe synth",
        "policy status",
        "feedback send",
    ):
        assert f"ok   harnessrl {command} --help" in shown, command
