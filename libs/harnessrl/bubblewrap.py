"""bubblewrap (bwrap) file-system plans, shared by the controller's harness sandbox and the
reward's test jail: mounts as data, the system directories, the directories leading to a
mount, Python installations.

Pure apart from reading the file system to find what exists. bwrap applies mounts in the
order given; `with_parents` orders them by depth (a path before anything under it) and makes
the directories leading to each one traversable by anyone and read-only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SYSTEM_DIRS = ("/usr", "/etc")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Symlinks into /usr on merged-/usr systems, directories elsewhere."""


@dataclass(frozen=True, slots=True)
class Mount:
    """One entry of a sandbox's file system."""

    kind: Literal["ro-bind", "bind", "tmpfs", "symlink", "proc", "dev", "dir", "remount-ro"]
    dest: str
    source: str = ""
    """What is bound there (bind kinds), or the link's target (symlink)."""
    size: int | None = None
    """tmpfs: its size in bytes."""
    perms: str = "0755"
    """tmpfs and dir: the mode of its root."""

    def args(self) -> list[str]:
        if self.kind in ("ro-bind", "bind", "symlink"):
            return [f"--{self.kind}", self.source, self.dest]
        if self.kind == "tmpfs":
            size = ["--size", str(self.size)] if self.size is not None else []
            return ["--perms", self.perms, *size, "--tmpfs", self.dest]
        if self.kind == "dir":
            return ["--perms", self.perms, "--dir", self.dest]
        return [f"--{self.kind}", self.dest]


def depth(mount: Mount) -> int:
    return len(Path(mount.dest).parts)


def under(path: Path, root: Path) -> bool:
    """Whether `path` is `root` or inside it (lexically)."""
    return path == root or root in path.parents


def system_mounts() -> list[Mount]:
    """The system directories, read-only, as this machine lays them out."""
    mounts = [Mount("ro-bind", d, d) for d in SYSTEM_DIRS if os.path.isdir(d)]
    for name in SYSTEM_LINKS:
        if os.path.islink(name):
            mounts.append(Mount("symlink", name, os.readlink(name)))
        elif os.path.isdir(name):
            mounts.append(Mount("ro-bind", name, name))
    return mounts


def is_system(path: Path) -> bool:
    """Whether `path` is / or shown by the system mounts anyway."""
    roots = (*SYSTEM_DIRS, *SYSTEM_LINKS)
    return path == Path("/") or any(under(path, Path(root)) for root in roots)


def venv_base(prefix: Path) -> list[Path]:
    """[the base interpreter's prefix] of the venv at `prefix` (its pyvenv.cfg `home`), or
    [] when `prefix` is not a venv."""
    config = prefix / "pyvenv.cfg"
    if not config.is_file():
        return []
    for line in config.read_text(errors="replace").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home" and value.strip():
            home = Path(os.path.realpath(value.strip()))
            return [home.parent if home.name == "bin" else home]
    return []


def with_parents(mounts: Iterable[Mount]) -> list[Mount]:
    """`mounts` sorted by depth, with the directories leading to each made first,
    traversable by anyone (bwrap would make them 0700 and its own, which a process dropped
    to another uid cannot enter), and read-only: one right under a writable tmpfs (mode
    1777) is a tmpfs of its own, remounted read-only once everything under it is mounted
    (an unprivileged sandbox owns what bwrap makes, and could write there otherwise). A
    directory inside a bind exists already."""
    ordered = sorted(mounts, key=depth)
    out: list[Mount] = []
    made: set[Path] = {Path("/")}
    binds: list[Path] = []
    writable = {Path(m.dest) for m in ordered if m.kind == "tmpfs" and m.perms == "1777"}
    sealed: list[Mount] = []
    for mount in ordered:
        dest = Path(mount.dest)
        for parent in reversed(dest.parents):
            if parent in made or any(under(parent, b) for b in binds):
                continue
            if parent.parent in writable:
                out.append(Mount("tmpfs", str(parent), size=1024 * 1024))
                sealed.append(Mount("remount-ro", str(parent)))
            else:
                out.append(Mount("dir", str(parent)))
            made.add(parent)
        out.append(mount)
        made.add(dest)
        if mount.kind in ("ro-bind", "bind"):
            binds.append(dest)
    return [*out, *sealed]
