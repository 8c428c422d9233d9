"""A fork server for Python harnesses: start each run from a process that already imported
what every run imports.

A short episode of a Python harness spends most of its CPU starting the interpreter and
importing its SDK (`import openai` alone is ~0.5 s). With `harness.preload: [openai]` the
local runner starts one server process that imports those modules once; each run of a
`python SCRIPT ARGS...` command is then a fork of it that becomes the run exactly as the
command would have: its own session (process group), working directory, environment (only
the run's), stdin from /dev/null, stdout and stderr into the runner's pipes, `sys.argv` and
`sys.path[0]` as `python SCRIPT` sets them, the script run as `__main__`, and the exit code
`python` would give (an uncaught exception: traceback on stderr, 1). The harness itself is
untouched; only where its interpreter comes from differs.

Protocol: requests go over a SOCK_SEQPACKET socket, each a JSON header message carrying the
run's stdout and stderr descriptors, followed by its payload in chunks; the server answers
on its stdout with lines `started <id> <pid>`, `failed <id> <reason>` and
`exited <pid> <returncode>` (negative: killed by that signal, as in subprocess).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from harnessrl.logs import get_logger

log = get_logger(__name__)

_CHUNK = 32 * 1024
_PYTHONS = {"python", "python3", Path(sys.executable).name}


def forkable(command: tuple[str, ...] | list[str]) -> bool:
    """Whether `command` is `python SCRIPT [ARGS...]` (no interpreter options), the only
    shape a fork server runs; anything else is executed as usual."""
    if len(command) < 2 or Path(command[0]).name not in _PYTHONS:
        return False
    return not command[1].startswith("-") and command[1].endswith(".py")


class ForkedProcess:
    """A run forked by the server, with the parts of asyncio's Process the runner uses."""

    def __init__(
        self, pid: int, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader
    ) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._exited = asyncio.get_running_loop().create_future()

    def _exit(self, returncode: int) -> None:
        if not self._exited.done():
            self.returncode = returncode
            self._exited.set_result(returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)


class ForkServer:
    """The runner's side: starts the server, sends it runs, follows their exits.

    The server process gets only `env` (the variables runs may inherit), never the
    controller's own environment: a forked run's /proc/self/environ is the server's.
    """

    def __init__(self, preload: list[str], env: dict[str, str]) -> None:
        self.preload = preload
        self.env = env
        self._process: asyncio.subprocess.Process | None = None
        self._socket: socket.socket | None = None
        self._lock = asyncio.Lock()
        self._next_id = 0
        self._started: dict[int, asyncio.Future[int]] = {}
        self._running: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self._reader: asyncio.Task[None] | None = None
        self.alive = False

    async def start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._socket = ours
        try:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "harnessrl.services.controller.forkserver",
                str(theirs.fileno()), *self.preload,
                pass_fds=[theirs.fileno()], stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, start_new_session=True, env=self.env,
            )  # fmt: skip
        finally:
            theirs.close()
        assert self._process.stdout is not None
        line = await self._process.stdout.readline()
        if line.strip() != b"ready":
            await self.stop()
            raise RuntimeError(f"fork server did not start (preload {self.preload}): {line!r}")
        self.alive = True
        self._reader = asyncio.create_task(self._follow(), name="fork server events")
        log.info("fork server ready", preload=self.preload, pid=self._process.pid)

    async def spawn(
        self, command: tuple[str, ...], cwd: Path, env: dict[str, str]
    ) -> ForkedProcess:
        """Start a run; raises OSError when the server cannot (the caller then executes)."""
        if not self.alive or self._socket is None:
            raise OSError(errno.ESRCH, "fork server is not running")
        loop = asyncio.get_running_loop()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            async with self._lock:
                self._next_id += 1
                request_id = self._next_id
                started = self._started[request_id] = loop.create_future()
                payload = json.dumps({"argv": list(command[1:]), "cwd": str(cwd), "env": env})
                data = payload.encode()
                header = json.dumps({"id": request_id, "size": len(data)}).encode()
                sock = self._socket
                await asyncio.to_thread(_send, sock, header, data, [out_w, err_w])
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        try:
            pid = await started
        except BaseException:
            for fd in (out_r, err_r):
                os.close(fd)
            raise
        stdout = await _reader_for(out_r)
        stderr = await _reader_for(err_r)
        process = ForkedProcess(pid, stdout, stderr)
        if pid in self._early_exits:
            process._exit(self._early_exits.pop(pid))
        else:
            self._running[pid] = process
        return process

    async def _follow(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        while line := await self._process.stdout.readline():
            kind, _, rest = line.decode().strip().partition(" ")
            first, _, second = rest.partition(" ")
            if kind == "started":
                future = self._started.pop(int(first), None)
                if future is not None and not future.done():
                    future.set_result(int(second))
            elif kind == "failed":
                future = self._started.pop(int(first), None)
                if future is not None and not future.done():
                    future.set_exception(OSError(errno.ECHILD, f"fork server: {second}"))
            elif kind == "exited":
                pid, code = int(first), int(second)
                process = self._running.pop(pid, None)
                if process is None:
                    self._early_exits[pid] = code
                else:
                    process._exit(code)
        if self.alive:
            self.alive = False
            log.error("fork server ended; runs are executed afresh from now on")
        for future in self._started.values():
            if not future.done():
                future.set_exception(OSError(errno.ESRCH, "fork server ended"))
        for process in self._running.values():
            process._exit(-signal.SIGKILL)  # its exit status went with the server

    async def stop(self) -> None:
        """Stop the server (runs already forked keep running). Idempotent."""
        self.alive = False
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._process.wait(), 5)
            if self._process.returncode is None:
                self._process.kill()
                await self._process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)


def _send(sock: socket.socket, header: bytes, data: bytes, fds: list[int]) -> None:
    socket.send_fds(sock, [header], fds)
    for start in range(0, len(data), _CHUNK):
        sock.sendall(data[start : start + _CHUNK])


async def _reader_for(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    pipe = os.fdopen(fd, "rb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    return reader


# --- the server --------------------------------------------------------------------------


def serve(sock: socket.socket, preload: list[str]) -> None:
    """Import `preload`, then fork a run per request until the socket closes."""
    for name in preload:
        importlib.import_module(name)
    import runpy  # noqa: F401  (the children run scripts with it)

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    _say("ready")
    while True:
        readable, _, _ = select.select([sock.fileno(), wake_r], [], [])
        if wake_r in readable:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
            _reap()
        if sock.fileno() in readable:
            message, fds, _, _ = socket.recv_fds(sock, _CHUNK, 2)
            if not message:
                return  # the runner closed the socket
            header = json.loads(message)
            data = bytearray()
            while len(data) < header["size"]:
                data += sock.recv(_CHUNK)
            request = json.loads(bytes(data))
            try:
                pid = os.fork()
            except OSError as err:
                _say(f"failed {header['id']} {err.strerror}")
                for fd in fds:
                    os.close(fd)
                continue
            if pid == 0:
                _become_run(request, fds, keep_closed=[sock.fileno(), wake_r, wake_w])
            for fd in fds:
                os.close(fd)
            _say(f"started {header['id']} {pid}")
            _reap()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _become_run(request: dict[str, Any], fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: turn into the run, execute the script, exit. Never returns."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for fd in keep_closed:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in (devnull, *fds):
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        script = request["argv"][0]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        code = _run_script(script)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _run_script(script: str) -> int:
    import atexit
    import runpy
    import traceback

    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            sys.stderr.write(f"{exit_.code}\n")
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    return code


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    serve(sock, args[1:])


if __name__ == "__main__":
    main()
