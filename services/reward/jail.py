"""The jail every test run of builtin:tests (and of `swe clean --validate`) runs in.

A test run executes code the policy wrote. In its bubblewrap jail it gets:

- **Processes.** Its own PID namespace: when the test command exits (or is killed), every
  process it left behind dies with the namespace, `setsid` or not. Its own IPC, UTS and
  cgroup namespaces, its own session (no terminal to inject into).
- **Network.** Its own network namespace: loopback only (up, so suites that serve on
  localhost work); nothing else is reachable.
- **Files.** Read-only: the system directories, the task's Python environment(s) and their
  base interpreters, the repository copy (the patch applied, the task's tests in place),
  and `read_only`. Writable: a private tmpfs /tmp (HOME and TMPDIR, `tmp_bytes`), gone
  with the run. Nothing else of the machine is in view: not the reward's scratch directory
  (so no pytest.ini or conftest.py can be left above the copy), not the task repository
  or its objects, not synthesis work trees, sdists or task files (no gold patch, no
  pristine source), not other runs. A run can therefore change nothing another run sees.
- **Identity.** Never the reward's privileges: as root, bwrap sets up the mounts and the
  run drops to an unprivileged uid of its own (`uid_base` + n) with no capabilities; as
  another user, the run is in a user namespace it cannot nest. At most `max_processes`
  processes, files of at most `max_file_bytes`.
- **The guard.** The test guard (`testguard.py`) is mounted into the environment's
  site-packages as `harnessrl_testguard` (a tmpfs holding the real entries, re-bound
  read-only, and the guard), so pytest can load it before anything of the repository. Its
  channel and key are pipes inherited through bwrap.

A jail that cannot be set up raises JailError: the run is an infrastructure failure (the
reward is missing), never a run outside the jail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from harnessrl.bubblewrap import Mount, is_system, system_mounts, under, venv_base, with_parents
from harnessrl.services.reward.config import TestsSettings
from harnessrl.services.reward.evidence import KEY_BYTES
from harnessrl.services.reward.group_run import RunOutcome, run_group

GUARD_SOURCE = Path(__file__).with_name("testguard.py")
GUARD_MODULE = "harnessrl_testguard"
HOSTNAME = "harnessrl-tests"
JAIL_TMP = "/tmp"
SETPRIV = "setpriv"
PRLIMIT = "prlimit"
_CHANNEL_FD, _KEY_FD = "HARNESSRL_GUARD_FD", "HARNESSRL_GUARD_KEY_FD"
CASES_FD = "HARNESSRL_CASES_FD"
"""For a run given `stdin` (the hidden cases' runner): the channel's descriptor."""


class JailError(RuntimeError):
    """The jail could not be set up: an infrastructure failure, never a score."""


@dataclass(frozen=True, slots=True)
class GuardView:
    """What the guard is told about the repository (paths relative to its root)."""

    tests: tuple[str, ...]
    """Test-side paths: the task's protected paths and the files its command names."""
    plugins: tuple[str, ...]
    """Plugin modules the task's configuration loads (they may hold hook implementations)."""


@dataclass(frozen=True, slots=True)
class JailedRun:
    outcome: RunOutcome
    channel: bytes
    """What the guard (or the hidden cases' runner) wrote; b"" when it never loaded."""
    key: bytes
    overflowed: bool = False
    """The run wrote more than `channel_cap_bytes` into the channel (the rest was dropped)."""


def python_prefixes(words: Sequence[str], search_path: str | None) -> list[Path]:
    """The Python installations a test command runs: for each word naming a Python
    interpreter or a pytest script (by path, or by name on `search_path`), its prefix
    (the directory above its bin/)."""
    found: list[Path] = []
    for before, word in zip(["", *words], words, strict=False):
        name = os.path.basename(word)
        if before == "-m":  # `python -m pytest` names a module, not a program
            continue
        if not (name.startswith("python") or name in ("pytest", "py.test")):
            continue
        program = word if os.path.isabs(word) else shutil.which(word, path=search_path)
        if program is None or not os.path.isfile(program):
            continue
        bin_dir = Path(os.path.abspath(program)).parent
        if bin_dir.name == "bin":
            found.append(bin_dir.parent)
    return list(dict.fromkeys(found))


def site_dirs(prefix: Path) -> list[Path]:
    """The site-packages directories of a Python prefix (a venv's, or a system layout's
    `lib/pythonX.Y/site-packages` and Debian's `dist-packages`)."""
    found: list[Path] = []
    for lib in ("lib", "lib64", "local/lib"):
        base = prefix / lib
        if base.is_dir() and not base.is_symlink():
            for name in ("site-packages", "dist-packages"):
                found += sorted(p for p in base.glob(f"python3*/{name}") if p.is_dir())
            if (base / "python3" / "dist-packages").is_dir():
                found.append(base / "python3" / "dist-packages")
    return list(dict.fromkeys(found))


def guard_mounts(site: Path) -> tuple[list[Mount], list[Mount]]:
    """(mounts, final remounts) that make `site` show its own entries and the guard:
    a tmpfs over it, each entry bound back read-only, the guard bound in, then read-only."""
    mounts = [Mount("tmpfs", str(site), size=1024 * 1024)]
    for entry in sorted(site.iterdir()):
        if entry.name != f"{GUARD_MODULE}.py":
            mounts.append(Mount("ro-bind", str(site / entry.name), str(entry)))
    mounts.append(Mount("ro-bind", str(site / f"{GUARD_MODULE}.py"), str(GUARD_SOURCE)))
    return mounts, [Mount("remount-ro", str(site))]


def file_mounts(
    repo: Path, prefixes: Iterable[Path], read_only: Iterable[Path], tmp_bytes: int
) -> list[Mount]:
    """The jail's file system, in the order bwrap applies it (see the module docstring)."""
    mounts = [
        *system_mounts(),
        Mount("proc", "/proc"),
        Mount("dev", "/dev"),
        Mount("tmpfs", JAIL_TMP, size=tmp_bytes, perms="1777"),
        Mount("ro-bind", str(repo), str(repo)),
    ]
    remounts: list[Mount] = []
    visible: list[Path] = []
    for prefix in dict.fromkeys(prefixes):
        for path in (prefix, *venv_base(prefix)):
            if not is_system(path) and path not in visible:
                visible.append(path)
        for site in site_dirs(prefix):
            guarded, sealed = guard_mounts(site)
            mounts += guarded
            remounts += sealed
    for path in read_only:
        if not is_system(path) and path not in visible:
            visible.append(path)
    mounts += [Mount("ro-bind", str(p), str(p)) for p in visible if not under(repo, p)]
    return [*with_parents(mounts), *remounts]


def jail_argv(
    bwrap: str,
    mounts: Iterable[Mount],
    *,
    cwd: Path,
    uid: int | None,
    limits: tuple[int, int],
    status_fd: int,
    command: Sequence[str],
) -> list[str]:
    """The bwrap command line. uid: the reward is root, the run drops to this uid (bwrap
    keeps only what setpriv needs for that); None: the reward is not root, the run is in a
    user namespace it cannot nest. limits: (processes, file bytes), set inside the jail
    (where the process limit counts the run's uid, or the run's user namespace, alone).
    bwrap reports on `status_fd` when the command starts and how it ended."""
    argv = [bwrap, "--die-with-parent", "--new-session", "--hostname", HOSTNAME]
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net"]
    argv += ["--unshare-cgroup-try", "--json-status-fd", str(status_fd)]
    if uid is None:
        argv += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    else:
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for mount in mounts:
        argv += mount.args()
    argv += ["--remount-ro", "/", "--chdir", str(cwd), "--"]
    argv += [PRLIMIT, f"--nproc={limits[0]}", f"--fsize={limits[1]}", "--core=0", "--"]
    if uid is not None:
        argv += [SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return [*argv, *command]


class Jail:
    """Runs test commands jailed; one instance serves any number of runs at once."""

    def __init__(self, settings: TestsSettings) -> None:
        self._settings = settings
        self._privileged = os.geteuid() == 0
        self._uids: set[int] = set()

    async def run(
        self,
        command: Sequence[str],
        *,
        repo: Path,
        prefixes: Sequence[Path],
        env: dict[str, str],
        guard: GuardView | None,
        timeout_s: float,
        on_line: Callable[[bytes], None] | None = None,
        stdin: bytes | None = None,
    ) -> JailedRun:
        """Run `command` in `repo` jailed, with `env` (plus the guard's variables when
        `guard` is given; plus CASES_FD, the channel, when `stdin` is: the command's input).
        The channel is read up to `channel_cap_bytes`, the rest drained and dropped.
        Raises JailError when the jail cannot be set up, OSError when bwrap cannot be
        started."""
        bwrap = shutil.which(self._settings.bwrap)
        if bwrap is None:
            raise JailError(
                f"reward.tests.bwrap: {self._settings.bwrap!r} not found: install bubblewrap "
                "(test runs never run outside their jail)"
            )
        for tool in (PRLIMIT, *([SETPRIV] if self._privileged else [])):
            if shutil.which(tool) is None:
                raise JailError(f"{tool} (util-linux) not found: the test jail needs it")
        mounts = file_mounts(repo, prefixes, self._settings.read_only, self._settings.tmp_bytes)
        uid = self._take_uid() if self._privileged else None
        key = secrets.token_bytes(KEY_BYTES)
        fds = _Pipes(key)
        try:
            jailed_env = dict(env)
            if guard is not None:
                jailed_env |= {
                    _CHANNEL_FD: str(fds.channel_w),
                    _KEY_FD: str(fds.key_r),
                    "HARNESSRL_GUARD_ROOT": str(repo),
                    "HARNESSRL_GUARD_TESTS": "\n".join(guard.tests),
                    "HARNESSRL_GUARD_PLUGINS": "\n".join(guard.plugins),
                }
            elif stdin is not None:
                jailed_env[CASES_FD] = str(fds.channel_w)
            limits = (self._settings.max_processes, self._settings.max_file_bytes)
            argv = jail_argv(
                bwrap,
                mounts,
                cwd=repo,
                uid=uid,
                limits=limits,
                status_fd=fds.status_w,
                command=command,
            )
            cap = self._settings.channel_cap_bytes
            reader = asyncio.create_task(asyncio.to_thread(_read_capped, fds.take_channel_r(), cap))
            status = asyncio.create_task(asyncio.to_thread(_read_capped, fds.take_status_r(), cap))
            try:
                outcome = await run_group(
                    argv,
                    cwd=Path("/"),
                    env=jailed_env,
                    timeout_s=timeout_s,
                    kill_grace_s=self._settings.kill_grace_s,
                    output_cap_bytes=self._settings.output_cap_bytes,
                    on_line=on_line,
                    pass_fds=fds.inherited(),
                    after_start=fds.close_inherited,
                    stdin=stdin,
                )
            finally:
                fds.close_inherited()
                channel, overflowed = await reader
                exit_code = _exit_code((await status)[0])
        finally:
            fds.close()
            if uid is not None:
                self._uids.discard(uid)
        if outcome.timed_out:
            return JailedRun(outcome, channel, key, overflowed)
        if exit_code is None:  # bwrap reports the command's end; it never got that far
            tail = outcome.output_tail.decode("utf-8", "replace").strip()[-1000:]
            raise JailError(f"the test jail could not be set up: {tail or 'no message'}")
        outcome = RunOutcome(exit_code, False, outcome.output_tail)
        return JailedRun(outcome, channel, key, overflowed)

    async def probe(self) -> None:
        """Run `true` in an empty jail; raises JailError when this machine (or container)
        cannot make one, so a reward service that must jail its test runs says so when it
        starts rather than leaving every coding episode without a reward."""
        with tempfile.TemporaryDirectory(prefix="harnessrl-jail-probe-") as empty:
            repo = Path(empty)
            os.chmod(empty, 0o755)  # a jail dropped to another uid reads it
            env = {"PATH": os.environ.get("PATH", os.defpath), "HOME": JAIL_TMP}
            try:
                run = await self.run(
                    ["true"], repo=repo, prefixes=[], env=env, guard=None, timeout_s=30
                )
            except OSError as err:
                raise JailError(f"reward.tests.bwrap: cannot start it: {err}") from err
        if run.outcome.exit_code != 0:
            tail = run.outcome.output_tail.decode("utf-8", "replace").strip()[-500:]
            raise JailError(
                f"the test jail runs nothing here (exit {run.outcome.exit_code}): {tail}"
            )

    def _take_uid(self) -> int:
        uid = self._settings.uid_base
        while uid in self._uids:
            uid += 1
        self._uids.add(uid)
        return uid


class _Pipes:
    """The run's channel (guard -> reward), key (reward -> guard) and bwrap status pipes."""

    def __init__(self, key: bytes) -> None:
        self.channel_r, self.channel_w = os.pipe()
        self.key_r, key_w = os.pipe()
        os.write(key_w, key)  # 32 bytes: far below a pipe's buffer
        os.close(key_w)
        self.status_r, self.status_w = os.pipe()
        self._open = {self.channel_r, self.channel_w, self.key_r, self.status_r, self.status_w}

    def inherited(self) -> tuple[int, ...]:
        return (self.channel_w, self.key_r, self.status_w)

    def close_inherited(self) -> None:
        """Our copies of the ends the jail holds: closed once it started, so that the
        readers see the end of each pipe when the jail's last process is gone."""
        for fd in self.inherited():
            self._close(fd)

    def take_channel_r(self) -> int:
        self._open.discard(self.channel_r)
        return self.channel_r

    def take_status_r(self) -> int:
        self._open.discard(self.status_r)
        return self.status_r

    def close(self) -> None:
        for fd in list(self._open):
            self._close(fd)

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.discard(fd)
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_capped(fd: int, cap: int) -> tuple[bytes, bool]:
    """What was written to the pipe until its last writer was gone, up to `cap` bytes, and
    whether more came (read and dropped: a writer is never left blocked, and a run that
    floods its channel costs the reader `cap` bytes of memory at most); the read end closed.
    """
    chunks, kept, overflowed = [], 0, False
    with os.fdopen(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1024 * 1024):
            if kept + len(chunk) > cap:
                chunk, overflowed = chunk[: cap - kept], True
            if chunk:
                chunks.append(chunk)
                kept += len(chunk)
    return b"".join(chunks), overflowed


def _exit_code(data: bytes) -> int | None:
    """The command's exit code from bwrap's --json-status-fd output (one JSON object per
    line; the last carries "exit-code" once the command has ended); None when bwrap never
    got to run it (a mount it could not make, say)."""
    exit_code = None
    for line in data.splitlines():
        try:
            item = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(item, dict) and isinstance(item.get("exit-code"), int):
            exit_code = item["exit-code"]
    return exit_code
