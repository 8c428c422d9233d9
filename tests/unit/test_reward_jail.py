"""The test jail's plan, decided without starting one: which Python environments a command
runs, the guard mounted into their site-packages, what is read-only and what is writable,
and the bwrap command line for a root and a non-root reward."""

from __future__ import annotations

import sys
from pathlib import Path

from harnessrl.bubblewrap import Mount
from harnessrl.services.reward.jail import (
    GUARD_MODULE,
    GUARD_SOURCE,
    file_mounts,
    jail_argv,
    python_prefixes,
    site_dirs,
)


def _venv(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    site = root / "lib" / "python3.11" / "site-packages"
    (site / "pytest").mkdir(parents=True)
    (site / "pluggy").mkdir()
    (root / "pyvenv.cfg").write_text(f"home = {Path(sys.base_prefix) / 'bin'}\n")
    return root


def test_the_environments_a_command_runs_are_found_in_its_words(tmp_path: Path) -> None:
    env = _venv(tmp_path / "env")
    words = ["env", "PYTHONPATH=.", str(env / "bin" / "python"), "-m", "pytest", "tests"]
    assert python_prefixes(words, None) == [env]
    assert python_prefixes(["python", "-m", "pytest"], str(env / "bin")) == [env]
    assert python_prefixes(["make", "test"], str(env / "bin")) == []
    assert site_dirs(env) == [env / "lib" / "python3.11" / "site-packages"]


def test_the_guard_joins_the_environment_read_only_and_the_copy_is_read_only(
    tmp_path: Path,
) -> None:
    env, repo = _venv(tmp_path / "env"), tmp_path / "work" / "repo"
    repo.mkdir(parents=True)
    site = env / "lib" / "python3.11" / "site-packages"
    mounts = file_mounts(repo, [env], [], 1 << 20)
    by_dest = {m.dest: m for m in mounts if m.kind != "remount-ro"}
    assert by_dest[str(repo)] == Mount("ro-bind", str(repo), str(repo))
    assert by_dest[str(env)] == Mount("ro-bind", str(env), str(env))
    assert by_dest[str(site)].kind == "tmpfs"
    assert by_dest[str(site / "pytest")] == Mount(
        "ro-bind", str(site / "pytest"), str(site / "pytest")
    )
    guard = by_dest[str(site / f"{GUARD_MODULE}.py")]
    assert (guard.kind, guard.source) == ("ro-bind", str(GUARD_SOURCE))
    assert by_dest["/tmp"] == Mount("tmpfs", "/tmp", size=1 << 20, perms="1777")
    # The site-packages tmpfs is sealed after everything is bound into it.
    assert mounts[-1] == Mount("remount-ro", str(site))
    order = [m.dest for m in mounts]
    assert order.index(str(site)) < order.index(str(site / "pytest")) < len(order) - 1
    # Nothing of the machine but what is named: not the copy's parent, not the scratch.
    binds = {m.source for m in mounts if m.kind in ("ro-bind", "bind")}
    assert str(tmp_path / "work") not in binds and str(tmp_path) not in binds
    assert not any(m.kind == "bind" for m in mounts)  # nothing writable is bound


def test_the_argv_isolates_every_namespace_and_drops_privileges() -> None:
    mounts = [Mount("ro-bind", "/usr", "/usr")]
    command = ["python", "-m", "pytest"]
    as_root = jail_argv(
        "bwrap",
        mounts,
        cwd=Path("/r"),
        uid=2_050_000_000,
        limits=(64, 1024),
        status_fd=9,
        command=command,
    )
    as_user = jail_argv(
        "bwrap", mounts, cwd=Path("/r"), uid=None, limits=(64, 1024), status_fd=9, command=command
    )
    for argv in (as_root, as_user):
        for flag in ("--unshare-pid", "--unshare-net", "--unshare-ipc", "--die-with-parent"):
            assert flag in argv
        assert argv[-3:] == command
        assert argv[argv.index("prlimit") + 1 : argv.index("prlimit") + 4] == [
            "--nproc=64",
            "--fsize=1024",
            "--core=0",
        ]
        assert "--remount-ro" in argv
        assert argv[argv.index("--json-status-fd") + 1] == "9"
    assert "--unshare-user" not in as_root
    assert "--reuid=2050000000" in as_root and "--clear-groups" in as_root
    assert as_root[as_root.index("--cap-add") + 1] == "CAP_SETUID"
    assert as_user[as_user.index("--unshare-user") : as_user.index("--unshare-user") + 4] == [
        "--unshare-user",
        "--disable-userns",
        "--cap-drop",
        "ALL",
    ]
    assert "setpriv" not in as_user
