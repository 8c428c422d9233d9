"""The wheel, built from the tracked files and installed in a fresh venv, works away from the
repository: `harnessrl --help`, `harnessrl up --help`, and every module of every service and
application imports from the installed copy.

The fresh venv gets the wheel alone (`--no-deps`); the dependencies it would download (torch
among them, several GB) are lent by the test's own environment through a path file, which adds
that site-packages directory to the search path without running its path files, so the
editable install of the checkout stays out of sight.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.typecheck import ROOT, package_folders

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
    python = env_dir / "bin" / "python"
    purelib = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], base
        ).strip()
    )
    (purelib / "lent-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            str(wheels[0]),
        ],
        base,
    )
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
