"""A private copy of a task's repository at its base commit, and the patch applied to it.

The copy is a clone (`--no-hardlinks`: the test run executes code the policy wrote in it,
and a hard-linked object file made writable there would change the source's too), checked
out detached at the base commit. The source repository is only read. Every git call has a
timeout, and is killed with its children when it runs over or its caller is cancelled.

What the patch touched is read from git's status after applying it: the copy was clean, so
every changed, deleted, added or ignored path is the patch's, both sides of a rename
included (`--no-renames`). The commit's own files (`tracked`, `blobs`) are read from its
objects, never from the working tree the patch changed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from harnessrl.process_group import kill_group

GIT_TIMEOUT_S = 300.0
"""Longest one git step may take (a clone over the network included)."""

_REPO_LOCATING_ENV = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
)
"""Inherited, these would point git at another repository than the one it runs in."""


@dataclass(frozen=True, slots=True)
class _GitResult:
    returncode: int
    stdout: bytes
    stderr: str


async def _git(*args: str, cwd: Path | None = None, stdin: bytes | None = None) -> _GitResult:
    """Run git; raises TimeoutError (named) after GIT_TIMEOUT_S, the process group killed."""
    env = {k: v for k, v in os.environ.items() if k not in _REPO_LOCATING_ENV}
    env["GIT_TERMINAL_PROMPT"] = "0"  # a clone needing credentials fails, never waits
    process = await asyncio.create_subprocess_exec(
        "git",
        *args,
        cwd=cwd,
        env=env,
        start_new_session=True,
        stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), GIT_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(f"git {args[0]}: no answer in {GIT_TIMEOUT_S:g} s") from None
    finally:
        if process.returncode is None:
            kill_group(process.pid, signal.SIGKILL)
            await process.wait()
    assert process.returncode is not None
    return _GitResult(process.returncode, out, err.decode("utf-8", "replace").strip())


def _checked(result: _GitResult, what: str) -> _GitResult:
    if result.returncode != 0:
        raise RuntimeError(f"{what}: {result.stderr or f'exit code {result.returncode}'}")
    return result


async def clone_at(repo: str, base_commit: str, dest: Path) -> None:
    """Clone `repo` into `dest` (which must not exist) and check out `base_commit` detached.

    The commit-ish is resolved in the copy as given, then as `origin/<it>` (a branch other
    than the default one). Raises ValueError naming the metadata field when the repository
    cannot be cloned or has no such commit.
    """
    cloned = await _git(
        "clone", "--no-checkout", "--no-hardlinks", "--quiet", "--", repo, str(dest)
    )
    if cloned.returncode != 0:
        raise ValueError(f"task metadata.repo: cannot clone {repo!r}: {cloned.stderr}")
    for candidate in (base_commit, f"origin/{base_commit}"):
        resolved = await _git(
            "rev-parse",
            "--verify",
            "--quiet",
            "--end-of-options",
            f"{candidate}^{{commit}}",
            cwd=dest,
        )
        if resolved.returncode == 0:
            sha = resolved.stdout.decode().strip()
            _checked(await _git("checkout", "--detach", "--quiet", sha, cwd=dest), "git checkout")
            return
    raise ValueError(f"task metadata.base_commit: {base_commit!r} is not a commit of {repo!r}")


async def apply_patch(copy: Path, patch: Path) -> str | None:
    """Apply the patch file to the copy's working tree; None when it applied, else git's
    message. git apply is atomic: a patch that fails leaves the copy as it was."""
    applied = await _git("apply", "--whitespace=nowarn", str(patch), cwd=copy)
    if applied.returncode == 0:
        return None
    return applied.stderr or f"exit code {applied.returncode}"


@dataclass(frozen=True, slots=True)
class Change:
    """One path the patch changed in the copy."""

    path: str
    """Repository-relative, with "/" separators."""
    kind: Literal["added", "modified", "deleted"]
    """added: not in the commit (untracked or ignored now); modified: content, mode or type
    (a file made a symbolic link) differs; deleted: gone from the working tree."""


async def changes(copy: Path) -> list[Change]:
    """Every path of the copy that differs from its commit: modified, deleted, added, ignored."""
    status = _checked(
        await _git(
            "status",
            "--porcelain=v1",
            "-z",
            "--no-renames",
            "--untracked-files=all",
            "--ignored=traditional",
            cwd=copy,
        ),
        "git status",
    )
    found = []
    # Each entry is "XY <path>"; with --no-renames none carries a second path. The index
    # is the commit's (git apply without --index), so the worktree column Y tells the kind.
    for entry in status.stdout.split(b"\0"):
        if not entry:
            continue
        code, path = entry[:2], os.fsdecode(entry[3:])
        if code in (b"??", b"!!"):
            found.append(Change(path, "added"))
        elif code[1:] == b"D":
            found.append(Change(path, "deleted"))
        else:
            found.append(Change(path, "modified"))
    return found


@dataclass(frozen=True, slots=True)
class TrackedFile:
    """A file of the commit."""

    mode: str
    """git's octal mode: "100644", "100755", "120000" (a symbolic link), "160000" (a
    submodule)."""
    blob: str
    """The object id of its content."""


async def tracked(copy: Path) -> dict[str, TrackedFile]:
    """The commit's files (HEAD of the copy), by repository-relative path."""
    listed = _checked(await _git("ls-tree", "-r", "-z", "HEAD", cwd=copy), "git ls-tree")
    files = {}
    for entry in listed.stdout.split(b"\0"):
        if entry:
            meta, _, path = entry.partition(b"\t")
            mode, _, blob = meta.decode().split(" ")
            files[os.fsdecode(path)] = TrackedFile(mode, blob)
    return files


async def blobs(copy: Path, ids: Iterable[str]) -> dict[str, bytes]:
    """The contents of the given blob ids, read from the copy's objects in one git call."""
    wanted = list(dict.fromkeys(ids))
    if not wanted:
        return {}
    request = "".join(f"{blob}\n" for blob in wanted).encode()
    batch = _checked(await _git("cat-file", "--batch", cwd=copy, stdin=request), "git cat-file")
    out, data, at = {}, batch.stdout, 0
    for blob in wanted:  # each answer: "<id> <type> <size>\n<content>\n"
        end = data.index(b"\n", at)
        header = data[at:end].decode().split(" ")
        if len(header) != 3 or header[1] != "blob":
            raise RuntimeError(f"git cat-file: {blob} is not a blob ({' '.join(header[1:])})")
        size = int(header[2])
        out[blob] = data[end + 1 : end + 1 + size]
        at = end + 1 + size + 1
    return out


async def restore(copy: Path, protected: Sequence[str]) -> None:
    """Put the protected paths back as the commit has them: tracked files restored, every
    other file under them removed (ignored ones too)."""
    if not protected:
        return
    listed = _checked(
        await _git("ls-tree", "-r", "-z", "--name-only", "HEAD", "--", *protected, cwd=copy),
        "git ls-tree",
    )
    files = [name for name in listed.stdout.split(b"\0") if name]
    if files:
        restored = await _git(
            "--literal-pathspecs",
            "checkout",
            "HEAD",
            "--pathspec-from-file=-",
            "--pathspec-file-nul",
            cwd=copy,
            stdin=b"\0".join(files),
        )
        _checked(restored, "git checkout (protected paths)")
    cleaned = await _git("--literal-pathspecs", "clean", "-ffdxq", "--", *protected, cwd=copy)
    _checked(cleaned, "git clean (protected paths)")
