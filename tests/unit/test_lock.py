"""The locks say what is installed, and they agree with pyproject.toml.

requirements/dev.lock (the project and its dev extra) and requirements/runtime.lock (what the
wheel declares: the images install it) are written by `make lock` from pyproject.toml and
requirements/lock.in. A dependency added, dropped or narrowed in pyproject.toml without
`make lock` fails here, and so does a venv that is not the lock (a package at another
version than the lock's, as a kept venv that resolved it on another day would have).
"""

from __future__ import annotations

import importlib.metadata
import re
import sysconfig
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = {
    "dev": ROOT / "requirements" / "dev.lock",
    "runtime": ROOT / "requirements" / "runtime.lock",
}
PYPROJECT = "harnessrl (pyproject.toml)"
"""How uv's `# via` comments name the project's own requirements."""


@dataclass(frozen=True)
class Locked:
    version: str
    hashes: frozenset[str]
    via: tuple[str, ...]


def read_lock(path: Path) -> dict[str, Locked]:
    """name -> its pin, hashes and what asked for it, as uv writes them."""
    entries: dict[str, Locked] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        head = re.match(r"([A-Za-z0-9._-]+)==([^\s\\]+)", block)
        if head is None:
            continue
        hashes = frozenset(re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
        via: list[str] = []
        if marker := re.search(r"# via(.*)", block):
            rest = block[marker.end() :].splitlines()
            via = [marker.group(1).strip()] if marker.group(1).strip() else [
                line.strip().lstrip("#").strip() for line in rest if line.strip().startswith("#")
            ]  # fmt: skip
        entries[canonicalize_name(head.group(1))] = Locked(head.group(2), hashes, tuple(via))
    return entries


def _inputs(extras: tuple[str, ...]) -> list[Requirement]:
    """pyproject.toml's requirements (with `extras`) and lock.in's, for this platform."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    lock_in = (ROOT / "requirements" / "lock.in").read_text().splitlines()
    lines += [line.split("#")[0].strip() for line in lock_in if line.split("#")[0].strip()]
    environment = default_environment()
    return [
        req
        for req in map(Requirement, lines)
        if req.marker is None or req.marker.evaluate(environment)  # type: ignore[arg-type]
    ]


def _declared(extras: tuple[str, ...]) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in extras:
        lines += project["optional-dependencies"][extra]
    return {canonicalize_name(Requirement(line).name) for line in lines}


@pytest.mark.parametrize(("lock", "extras"), [("dev", ("dev",)), ("runtime", ())])
def test_every_requirement_is_locked_at_a_version_it_allows(
    lock: str, extras: tuple[str, ...]
) -> None:
    locked = read_lock(LOCKS[lock])
    for req in _inputs(extras):
        name = canonicalize_name(req.name)
        assert name in locked, f"{req} is not in {LOCKS[lock].name}: run `make lock`"
        version = locked[name].version
        assert req.specifier.contains(version, prereleases=True), (
            f"{LOCKS[lock].name} pins {name}=={version}, which {req} refuses: run `make lock`"
        )
    for name in _declared(extras):
        assert PYPROJECT in locked[name].via, (
            f"{LOCKS[lock].name} holds {name} for other packages only, not for "
            "pyproject.toml: run `make lock`"
        )


@pytest.mark.parametrize(("lock", "extras"), [("dev", ("dev",)), ("runtime", ())])
def test_the_lock_holds_only_what_the_requirements_pull(lock: str, extras: tuple[str, ...]) -> None:
    """Everything locked is asked for by pyproject.toml, lock.in or another locked package:
    a requirement dropped from pyproject.toml leaves no package behind."""
    locked = read_lock(LOCKS[lock])
    declared = _declared(extras)
    for name, entry in locked.items():
        assert entry.via, f"{name}: the lock does not say what asks for it"
        if any(v.startswith(PYPROJECT) for v in entry.via):
            assert name in declared, f"{name} is locked for pyproject.toml, which no longer asks"
        parents = [v for v in entry.via if not v.startswith(("harnessrl", "-r ", "-c "))]
        known = [p for p in parents if canonicalize_name(p) in locked]
        assert known or len(parents) < len(entry.via), f"{name}: asked for by {entry.via}"


def test_every_locked_package_is_hashed() -> None:
    for path in LOCKS.values():
        for name, entry in read_lock(path).items():
            assert entry.hashes, f"{path.name}: {name} has no hash (pip --require-hashes)"


def test_the_runtime_lock_is_the_dev_lock_s_versions() -> None:
    dev, runtime = read_lock(LOCKS["dev"]), read_lock(LOCKS["runtime"])
    for name, entry in runtime.items():
        assert name in dev, f"{name} is in runtime.lock but not dev.lock"
        assert entry.version == dev[name].version, f"{name}: the two locks pin different versions"
        assert entry.hashes <= dev[name].hashes, f"{name}: the two locks hash different files"


def test_the_venv_is_the_lock() -> None:
    """What the tests run on is what the lock says: every locked package installed at its
    locked version (CI's venv is made from the lock; a venv that resolved on another day
    would pass or fail for reasons the lock does not hold)."""
    if not Path(sysconfig.get_path("purelib")).is_relative_to(ROOT / ".venv"):
        pytest.skip("not running in the checkout's .venv (made by `make venv`)")
    wrong = []
    for name, entry in read_lock(LOCKS["dev"]).items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            wrong.append(f"{name} missing")
            continue
        if installed != entry.version:
            wrong.append(f"{name} {installed} (locked {entry.version})")
    assert not wrong, f"the venv is not the lock (`make venv` makes it anew): {wrong}"


def test_read_lock_reads_pins_hashes_and_parents(tmp_path: Path) -> None:
    lock = tmp_path / "x.lock"
    lock.write_text(
        "# header\nanyio==4.0 \\\n    --hash=sha256:" + "a" * 64 + "\n    # via\n"
        "    #   harnessrl (pyproject.toml)\n    #   httpx\nidna==3.7 \\\n    --hash=sha256:"
        + "b" * 64
        + "\n    # via anyio\n"
    )
    entries = read_lock(lock)
    assert entries["anyio"] == Locked("4.0", frozenset({"a" * 64}), (PYPROJECT, "httpx"))
    assert entries["idna"].via == ("anyio",)
