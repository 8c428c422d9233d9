"""A pinned project's source as a git repository: the first step of `swe synth`.

    repo = checkout(project, work_dir)     # work_dir/<name>-<version>/ (a git repository)

The sdist comes from the package index pip is configured with (`pip download --no-deps
--no-binary :all:`, so a mirror works as PyPI does), its sha256 is checked against the pin
before it is opened, and it is unpacked with the archive's members checked (no absolute
paths, no `..`, no links out, regular files and directories only). The tree becomes one
commit made with a fixed author and date, so the same pin gives the same commit id on any
machine. Build leftovers the sdist carries (`*.egg-info`, `PKG-INFO`) are left out.
Idempotent: an existing checkout at the expected commit is reused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from harnessrl.apps.swe.projects import Project

GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "harnessrl",
    "GIT_AUTHOR_EMAIL": "harnessrl@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "harnessrl",
    "GIT_COMMITTER_EMAIL": "harnessrl@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
"""Who and when every synthesized commit is: fixed, so commit ids are reproducible."""


class FetchError(RuntimeError):
    """The sdist could not be fetched, did not match its pin, or is unsafe to unpack."""


def download(project: Project, into: Path, timeout_s: float = 300.0) -> Path:
    """The project's sdist, downloaded into `into` and checked against its sha256."""
    into.mkdir(parents=True, exist_ok=True)
    before = set(into.iterdir())
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"),
            *("--disable-pip-version-check", "--quiet", "--dest", str(into)),
            project.requirement,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise FetchError(f"{project.requirement}: pip download failed: {done.stderr[-2000:]}")
    new = [p for p in into.iterdir() if p not in before and _is_archive(p)]
    found = new or [p for p in into.iterdir() if _is_archive(p) and _named(p, project)]
    if len(found) != 1:
        raise FetchError(f"{project.requirement}: expected one sdist in {into}, found {found}")
    archive = found[0]
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != project.sha256:
        archive.unlink()
        raise FetchError(
            f"{project.requirement}: sha256 {digest} of {archive.name}, pinned {project.sha256}"
        )
    return archive


def checkout(project: Project, work_dir: Path, downloads: Path | None = None) -> Path:
    """work_dir/<name>-<version>: the sdist's tree as a git repository of one commit
    (downloading the sdist into `downloads`, default work_dir/sdists, when need be)."""
    repo = work_dir / f"{project.name}-{project.version}"
    if (repo / ".git").is_dir() and _head(repo) is not None and _clean(repo):
        return repo
    archive = download(project, downloads or work_dir / "sdists")
    work_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{project.name}-", dir=work_dir))
    try:
        tree = _unpack(archive, staging)
        for leftover in [*tree.glob("*.egg-info"), *tree.glob("*/*.egg-info"), tree / "PKG-INFO"]:
            if leftover.is_dir():
                shutil.rmtree(leftover)
            elif leftover.exists():
                leftover.unlink()
        _commit(tree, f"{project.requirement} from its sdist")
        if repo.exists():
            shutil.rmtree(repo)
        tree.rename(repo)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return repo


def _is_archive(path: Path) -> bool:
    return path.name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".zip"))


def _named(path: Path, project: Project) -> bool:
    stem = path.name.lower().replace("-", "_")
    return stem.startswith(f"{project.name.lower().replace('-', '_')}_{project.version}.")


def _unpack(archive: Path, into: Path) -> Path:
    """The archive's single top-level directory, unpacked under `into`."""
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zipped:
            names = zipped.namelist()
            for name in names:
                _safe(archive, name)
            zipped.extractall(into)
    else:
        with tarfile.open(archive) as tarred:
            members = tarred.getmembers()
            for member in members:
                _safe(archive, member.name)
                if not (member.isfile() or member.isdir()):
                    raise FetchError(f"{archive.name}: {member.name} is not a file or directory")
            tarred.extractall(into, filter="data")
    tops = [p for p in into.iterdir()]
    if len(tops) != 1 or not tops[0].is_dir():
        raise FetchError(f"{archive.name}: expected one top-level directory, found {tops}")
    return tops[0]


def _safe(archive: Path, name: str) -> None:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or "\\" in name:
        raise FetchError(f"{archive.name}: unsafe member path {name!r}")


def git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """git in `repo` with the fixed identity and no machine or user configuration."""
    # Neither the machine's nor the user's git configuration: the same commit everywhere.
    env = {**os.environ, **GIT_IDENTITY, "GIT_CONFIG_NOSYSTEM": "1"}
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    return subprocess.run(
        ["git", "-c", "init.defaultBranch=main", "-c", "core.autocrlf=false", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def _commit(tree: Path, message: str) -> str:
    for args in (("init", "-q"), ("add", "-A", "-f", "."), ("commit", "-q", "-m", message)):
        done = git(tree, *args)
        if done.returncode != 0:
            raise FetchError(f"git {args[0]} in {tree}: {done.stderr.strip()}")
    head = _head(tree)
    assert head is not None
    return head


def _head(repo: Path) -> str | None:
    done = git(repo, "rev-parse", "--verify", "-q", "HEAD")
    return done.stdout.strip() if done.returncode == 0 else None


def _clean(repo: Path) -> bool:
    done = git(repo, "status", "--porcelain", "--ignored")
    return done.returncode == 0 and not done.stdout.strip()
