"""Containment of local harness runs with bubblewrap (`controller.sandbox.mode: bwrap`).

A harness executes what the policy writes. Unsandboxed, it runs as the controller's user:
it could delete files outside its directory, read the controller's state, or publish forged
events on a broker that listens without authentication. A sandboxed run instead gets:

- **Files.** Its own directory (`workdir/<episode>-<attempt>/`, at its own path) is the only
  host directory it can write. Read-only: /usr, /etc and the /bin, /lib... links; the
  controller's Python installations (venv and base interpreter, which the sandbox's init
  runs on); the installation of the command's program (a venv with its base interpreter,
  else the parent of its bin/, or only the program where that parent is /, HOME or right
  under either); every argument of the command that is an absolute path to a file; and
  `sandbox.read_only`. A private tmpfs /tmp and /dev/shm (`tmp_bytes` each; HOME=/tmp/home,
  TMPDIR=/tmp), a fresh /proc, a minimal /dev. Never visible: the controller's state
  directory, its workdir (other runs), the relay's directory (read-only paths inside them
  are left out, with a warning), and of HOME only what is named above: each is masked by
  an empty tmpfs where a read-only path would show it. The directories leading to what is
  mounted are empty and read-only. Every mount is nosuid (and nodev, but for /dev's few
  devices); no privilege can be gained (no_new_privs).
- **Processes.** Its own PID, IPC, UTS, cgroup and mount namespaces and session, with an
  init of ours as pid 1 (`sandbox_init.py`): when the harness exits, everything it left
  running dies with the namespace. The init's host pid leads its own process group, which
  the runner treats as the run's: the SIGTERM at the timeout is passed on by the init to
  every process of the run; SIGKILL (after the grace, `kill()`, or a restarted controller
  finding the run's record) kills the init and so the whole run. A controller that dies
  takes its runs with it (the init exits when its control socket closes).
- **Limits** (per run): at most `max_processes` processes and threads; per process
  `max_address_space_bytes`, `max_file_bytes`, `max_open_files`, `max_cpu_s`. The process
  limit is RLIMIT_NPROC, which the kernel counts per user and never enforces for uid 0, so
  a controller running as root runs each harness as an unprivileged uid of its own
  (`uid_base` + n, no capabilities, its directory chowned to it, a name in the sandbox's
  /etc/passwd), and an unprivileged controller runs it in a user namespace, where the
  limit (set inside it) counts that namespace's processes alone (Linux 5.14 and later).
- **Network.** Its own network namespace: loopback only, so the broker, the gateway's admin
  port, the host's services (abstract unix sockets included) and the internet are
  unreachable, and DNS resolves nothing. The init listens on 127.0.0.1 and ::1 at the
  gateway's port and carries each connection (at most `max_gateway_connections` at once)
  to a unix socket bound into the sandbox, whose connections the controller relays to the
  gateway (`sandbox_relay.py`). Environment values that start with `gateway_url` (the base
  URLs) are rewritten for it: an IP literal becomes 127.0.0.1; a name is kept and mapped to
  127.0.0.1 in the sandbox's /etc/hosts, so TLS still verifies.

Limits of the containment: the harness shares the host's kernel and may make any system
call (no seccomp filter), so a kernel bug is a way out; it reads what the run's uid may
read of /usr and /etc; memory is bounded per process (address space), not per run, and
the disk its directory takes not at all; CPU seconds are per process (the wall-clock
timeout bounds the run); as root, the harness may still create user namespaces where the
host allows unprivileged ones (it sees nothing more there and keeps its process limit);
an unprivileged controller needs unprivileged user namespaces, which some distributions
restrict, and the gateway on a port of at least 1024. Sandboxed runs never use the fork
server (`harness.preload`): each is a fresh bwrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson

from harnessrl.bubblewrap import system_mounts
from harnessrl.logs import get_logger
from harnessrl.services.controller.config import SandboxSettings
from harnessrl.services.controller.runner import LaunchError
from harnessrl.services.controller.sandbox_plan import (
    GATEWAY_SOCKET,
    HOME,
    INIT,
    GatewayAddress,
    bwrap_argv,
    command_paths,
    file_mounts,
    python_paths,
    sandbox_env,
)
from harnessrl.services.controller.sandbox_relay import GatewayRelay

log = get_logger(__name__)

_INIT_SOURCE = Path(__file__).with_name("sandbox_init.py")
_EXIT_REPORT_S = 5.0


class SandboxedProcess:
    """A run inside bwrap, with the parts of asyncio's Process the runner uses. `pid` is the
    sandbox's init as the host sees it, the leader of its own process group: SIGTERM to that
    group reaches every process of the run (the init passes it on), SIGKILL ends it all."""

    def __init__(
        self,
        process: asyncio.subprocess.Process,
        init_pid: int,
        control: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        cleanup: Callable[[], Awaitable[None]],
    ) -> None:
        assert process.stdout is not None and process.stderr is not None
        self.pid = init_pid
        self.stdout = process.stdout
        self.stderr = process.stderr
        self.returncode: int | None = None
        self._process = process
        self._control = control
        self._cleanup = cleanup
        self._ended = asyncio.ensure_future(self._end())

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    async def _end(self) -> int:
        try:
            await self._process.wait()
            code = await asyncio.wait_for(_exit_report(self._control[0]), _EXIT_REPORT_S)
        except TimeoutError:
            code = None
        finally:
            self._control[1].close()
            await self._cleanup()
        # Not reported: the init itself was killed (the run was), or never got to run.
        self.returncode = code if code is not None else self._process.returncode
        assert self.returncode is not None
        return self.returncode


async def _exit_report(reader: asyncio.StreamReader) -> int | None:
    code = None
    while line := await reader.readline():
        kind, _, value = line.decode("utf-8", "replace").strip().partition(" ")
        if kind == "exit":
            code = int(value)
    return code


class Sandbox:
    """Starts local harness runs inside bwrap; see the module docstring.

    Holds a private directory (mode 0700) for the relays' sockets and the files bound over
    the sandbox's /etc/hosts (and, as root, /etc/passwd and /etc/group, so the run's uid
    has a name); `stop()` removes it.
    """

    def __init__(
        self, settings: SandboxSettings, *, gateway_url: str, workdir: Path, state_dir: Path
    ) -> None:
        self.settings = settings
        self.gateway_url = gateway_url
        """The gateway a run is relayed to when its spawn names none."""
        self.privileged = os.geteuid() == 0
        self._hidden = [workdir.resolve(), state_dir.resolve()]
        self._dir: Path | None = None
        self._uids: set[int] = set()
        self._sockets = itertools.count()

    async def probe(self) -> None:
        """Make one empty sandbox, as runs get theirs (namespaces, /proc, the user namespace
        of an unprivileged controller); raises LaunchError naming the setting when this
        machine (or container) cannot: checked when the runner starts, so a controller that
        cannot contain its harnesses says so at once instead of failing every run."""
        bwrap = shutil.which(self.settings.bwrap)
        if bwrap is None:
            raise LaunchError(
                f"controller.sandbox.bwrap: {self.settings.bwrap!r} not found (install "
                "bubblewrap, or set controller.sandbox.mode: off to run harnesses uncontained)"
            )
        argv = [bwrap, "--die-with-parent", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
        argv += ["--unshare-net", "--unshare-cgroup-try"]
        if not self.privileged:
            argv += ["--unshare-user", "--disable-userns"]
        for mount in system_mounts():
            argv += mount.args()
        argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "true"]
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), self.settings.setup_timeout_s)
        except TimeoutError:
            process.kill()
            await process.wait()
            stderr = b"no answer within controller.sandbox.setup_timeout_s"
        if process.returncode != 0:
            why = stderr.decode("utf-8", "replace").strip() or f"exit code {process.returncode}"
            raise LaunchError(
                f"controller.sandbox.mode: {self.settings.mode}, but bwrap cannot make a "
                f"sandbox here ({why}). In a container, give the controller what "
                "deploy/README.md lists; or set controller.sandbox.mode: off to run harnesses "
                "uncontained: they then run as the controller's user, see its files and "
                "environment (its secrets), and reach every network it reaches (the broker)"
            )

    async def stop(self) -> None:
        """Remove the private directory (runs in progress keep their relays). Idempotent."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    async def spawn(
        self,
        command: tuple[str, ...],
        run_dir: Path,
        env: dict[str, str],
        gateway_url: str = "",
    ) -> SandboxedProcess:
        """Start `command` sandboxed in `run_dir` with `env` (rewritten for the sandbox),
        relayed to `gateway_url` (its episode's gateway replica; default the sandbox's);
        raises LaunchError, naming the setting at fault where there is one, when the
        sandbox cannot be set up or the command cannot be executed in it."""
        gateway_url = gateway_url or self.gateway_url
        gateway = GatewayAddress.parse(gateway_url)
        bwrap = shutil.which(self.settings.bwrap)
        if bwrap is None:
            raise LaunchError(
                f"controller.sandbox.bwrap: {self.settings.bwrap!r} not found (install "
                "bubblewrap, or set controller.sandbox.mode: off to run unsandboxed)"
            )
        missing = [str(p) for p in self.settings.read_only if not p.exists()]
        if missing:
            raise LaunchError(f"controller.sandbox.read_only: {', '.join(missing)} not found")
        private = self._private_dir()
        uid = self._take_uid() if self.privileged else None
        relay = GatewayRelay(
            private / f"{next(self._sockets)}.sock",
            gateway.host,
            gateway.port,
            max_connections=self.settings.max_gateway_connections,
            owner=uid,
        )

        async def cleanup() -> None:
            await relay.stop()
            if uid is not None:
                self._uids.discard(uid)

        try:
            if uid is not None:
                await asyncio.to_thread(_chown_tree, run_dir, uid)
            await relay.start()
            return await self._start(
                bwrap,
                command,
                run_dir,
                env=env,
                relay=relay,
                uid=uid,
                cleanup=cleanup,
                gateway_url=gateway_url,
            )
        except BaseException:
            await cleanup()
            raise

    async def _start(
        self,
        bwrap: str,
        command: tuple[str, ...],
        run_dir: Path,
        *,
        env: dict[str, str],
        relay: GatewayRelay,
        uid: int | None,
        cleanup: Callable[[], Awaitable[None]],
        gateway_url: str,
    ) -> SandboxedProcess:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        info_r, info_w = os.pipe()
        fds = [theirs.fileno(), info_w]
        gateway = GatewayAddress.parse(gateway_url)
        argv = self._argv(
            bwrap, command, run_dir, env=env, relay=relay, uid=uid, fds=fds, gateway=gateway
        )
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                cwd="/",
                env=sandbox_env(env, gateway_url),
                pass_fds=fds,
                start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as err:
            ours.close()
            os.close(info_r)
            raise LaunchError(f"controller.sandbox.bwrap: cannot start {bwrap!r}: {err}") from err
        finally:
            theirs.close()
            os.close(info_w)
        control = await asyncio.open_unix_connection(sock=ours)
        try:
            async with asyncio.timeout(self.settings.setup_timeout_s):
                info = await asyncio.to_thread(_read_all, info_r)
                line = await control[0].readline()
        except TimeoutError:
            info = b""
            line = b"failed the sandbox did not start within controller.sandbox.setup_timeout_s"
        except BaseException:
            await _discard(process, control)
            raise
        if line == b"started\n":
            try:
                init_pid = int(orjson.loads(info)["child-pid"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                line = b"failed bwrap reported no child-pid on --info-fd: " + info[:200]
            else:
                return SandboxedProcess(process, init_pid, control, cleanup)
        report = line.decode("utf-8", "replace").strip()
        stderr = await _discard(process, control)
        if report.startswith("failed "):
            raise LaunchError(f"the sandbox could not start the harness: {report[7:]}")
        raise LaunchError(
            f"the sandbox could not be set up ({bwrap} exited {process.returncode}): "
            f"{report or stderr or 'no message'}"
        )

    def _argv(
        self,
        bwrap: str,
        command: tuple[str, ...],
        run_dir: Path,
        *,
        env: dict[str, str],
        relay: GatewayRelay,
        uid: int | None,
        fds: list[int],
        gateway: GatewayAddress,
    ) -> list[str]:
        private = self._private_dir()
        support = {"/etc/hosts": self._hosts(gateway), str(INIT): _INIT_SOURCE}
        support[str(GATEWAY_SOCKET)] = relay.path
        if uid is not None:
            support |= {"/etc/passwd": private / f"passwd-{uid}"}
            support |= {"/etc/group": private / f"group-{uid}"}
        python = os.path.realpath(sys.executable)
        home = Path(os.environ["HOME"]).resolve() if "HOME" in os.environ else None
        read_only = [
            *python_paths(),
            *command_paths(command, env.get("PATH"), home),
            *self.settings.read_only,
        ]
        mounts, refused = file_mounts(
            run_dir=run_dir,
            read_only=read_only,
            hidden=[*self._hidden, private],
            masked=[home] if home is not None else [],
            support=support,
            tmp_bytes=self.settings.tmp_bytes,
        )
        if refused:
            log.warning(
                "sandbox: read-only paths inside the controller's directories left out",
                paths=[str(p) for p in refused],
            )
        config = {
            "control_fd": fds[0],
            "port": gateway.port,
            "socket": str(GATEWAY_SOCKET),
            "max_connections": self.settings.max_gateway_connections,
            "uid": uid,
            "home": HOME,
            "limits": self._limits(),
            "argv": list(command),
            "cwd": str(run_dir),
        }
        init = [python, "-I", "-S", "-B", str(INIT), orjson.dumps(config).decode()]
        return bwrap_argv(
            bwrap, mounts, privileged=self.privileged, cwd=run_dir, info_fd=fds[1], command=init
        )

    def _limits(self) -> dict[str, int]:
        settings = self.settings
        limits = {
            "NPROC": settings.max_processes,
            "NOFILE": settings.max_open_files,
            "AS": settings.max_address_space_bytes,
            "FSIZE": settings.max_file_bytes,
            "CPU": settings.max_cpu_s,
        }
        return {name: value for name, value in limits.items() if value is not None}

    def _private_dir(self) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="harnessrl-sandbox-"))
        return self._dir

    def _hosts(self, gateway: GatewayAddress) -> Path:
        """The /etc/hosts of runs relayed to `gateway` (its name maps to the relay)."""
        text = gateway.hosts_file()
        path = self._private_dir() / f"hosts-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        if not path.exists():
            path.write_text(text)
        return path

    def _take_uid(self) -> int:
        uid = next(u for u in itertools.count(self.settings.uid_base) if u not in self._uids)
        self._uids.add(uid)
        private = self._private_dir()
        for name, entry in (
            ("passwd", f"harness:x:{uid}:{uid}:harness run:{HOME}:/bin/sh\n"),
            ("group", f"harness:x:{uid}:\n"),
        ):
            path = private / f"{name}-{uid}"
            if not path.exists():
                host = Path(f"/etc/{name}").read_text() if os.path.exists(f"/etc/{name}") else ""
                path.write_text(host + ("" if host.endswith("\n") or not host else "\n") + entry)
        return uid


def _read_all(fd: int) -> bytes:
    """What bwrap writes to its --info-fd (it closes it once written, or on failure)."""
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _chown_tree(root: Path, uid: int) -> None:
    """Give the run's directory (and whatever was prepared in it) to the run's uid."""
    os.chown(root, uid, uid)
    for parent, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            os.lchown(os.path.join(parent, name), uid, uid)


async def _discard(
    process: asyncio.subprocess.Process, control: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> str:
    """End a sandbox that did not start; what bwrap said on stderr."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    control[1].close()
    assert process.stderr is not None
    stderr = await process.stderr.read(4096)
    await process.wait()
    return stderr.decode("utf-8", "replace").strip()
