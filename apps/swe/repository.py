"""A synthesized task's repository: one commit holding a project's tree with a bug (and
with the held-back tests cut), nothing else; and the gold patch as `git diff` writes it.

    commit = task_repository(pristine, {path: new_text, ...}, repos / "<id>.<digest>.git")

The repository is bare, its one commit made with a fixed author and date (the same tree
gives the same commit id on any machine), and it holds only that tree's objects: no
history, no pristine file, not even as a loose object. An existing repository is reused
when it holds exactly that tree, and made again otherwise.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
import tempfile
from pathlib import Path

from harnessrl.apps.swe.fetch import git


def unified_patch(path: str, before: str, after: str) -> str:
    """The change from `before` to `after` of the file at `path`, as `git diff` writes it
    (`git apply` takes it)."""
    lines = difflib.unified_diff(
        before.splitlines(keepends=True),
        after.splitlines(keepends=True),
        f"a/{path}",
        f"b/{path}",
    )
    body = []
    for line in lines:
        body.append(line)
        if not line.endswith("\n"):
            body.append("\n\\ No newline at end of file\n")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def task_repository(pristine: Path, changes: dict[str, str], repo: Path) -> str:
    """A bare repository at `repo` whose one commit is `pristine`'s HEAD tree with
    `changes` (path -> new text) written over it; its commit id (the same tree gives the
    same id: fixed author and date). Only the objects of that tree are in it."""
    if repo.exists():
        head = git(repo, "rev-parse", "--verify", "-q", "HEAD")
        if head.returncode == 0 and _holds_changes(repo, pristine, changes):
            return head.stdout.strip()
        shutil.rmtree(repo)  # unfinished, or made with other changes (another hold-back)
    repo.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=repo.parent))
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=repo.parent))
    try:
        export(pristine, staging)
        for path, text in changes.items():
            (staging / path).write_bytes(text.encode("utf-8"))
        git_dir = str(building)
        for args in (
            ("init", "-q", "--bare", git_dir),
            ("--git-dir", git_dir, "--work-tree", str(staging), "add", "-A", "-f", "."),
            ("--git-dir", git_dir, "--work-tree", str(staging), "commit", "-q", "-m", "import"),
        ):
            done = git(staging, *args)
            if done.returncode != 0:
                raise RuntimeError(f"git {' '.join(args[:3])}: {done.stderr.strip()}")
        (building / "index").unlink(missing_ok=True)
        for hook in (building / "hooks").glob("*"):
            hook.unlink()
        building.rename(repo)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(building, ignore_errors=True)
    head = git(repo, "rev-parse", "HEAD")
    return head.stdout.strip()


def _holds_changes(repo: Path, pristine: Path, changes: dict[str, str]) -> bool:
    """Whether the repository's HEAD is `pristine`'s HEAD tree with exactly `changes`."""
    ours, theirs = _tree(repo), _tree(pristine)
    for path in ours.keys() | theirs.keys() | changes.keys():
        if path not in changes:
            if ours.get(path) != theirs.get(path):
                return False
            continue
        held = subprocess.run(
            ["git", "-C", str(repo), "cat-file", "blob", f"HEAD:{path}"],
            capture_output=True,
            check=False,
        )
        if held.returncode != 0 or held.stdout != changes[path].encode("utf-8"):
            return False
    return True


def _tree(repo: Path) -> dict[str, str]:
    """Path -> "mode blob" of every file of the repository's HEAD."""
    listed = git(repo, "ls-tree", "-r", "-z", "HEAD")
    files = {}
    for entry in listed.stdout.split("\0"):
        if entry:
            meta, _, path = entry.partition("\t")
            mode, _, blob = meta.split(" ")
            files[path] = f"{mode} {blob}"
    return files


def export(repo: Path, into: Path) -> None:
    """`repo`'s HEAD tree (tracked files only) into `into`."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", "HEAD"],
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
