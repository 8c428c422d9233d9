"""Harness runs as local processes.

Each run gets its own session (so its own process group: the harness and every child it
starts), an environment made of the LaunchSpec's plus only the allowed variables of the
controller's own (never its secrets), its own working directory under
`workdir/<episode>-<attempt>/`, `HARNESSRL_OUTPUT`
pointing at `result.json` there, and stdout/stderr written to `stdout.log`/`stderr.log`
there, each cut at `log_cap_bytes` (the end of stdout is also kept in memory for the
`HARNESSRL_RESULT` line). At its timeout the whole group gets SIGTERM, then SIGKILL after
the grace; when the harness exits, whatever it left running in its group is killed too, so
no orphan survives an episode.

A record per run (`state_dir/runs/<episode>-<attempt>.json`: pid, process group) lets a
restarted controller find what it was running: those runs are killed (their exit status
cannot be known any more) and reported "abandoned", and the controller retries them.

With `controller.sandbox` on, each run is executed inside bubblewrap instead (`sandbox.py`:
what it can see, write and reach); the process group above is then the sandbox's init's,
which passes SIGTERM on to every process of the run and whose death ends them all.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import time
from collections import deque
from pathlib import Path
from typing import IO

import orjson

from harnessrl.logs import get_logger
from harnessrl.process_group import group_alive, kill_group, terminate_group
from harnessrl.services.controller.config import ControllerSection
from harnessrl.services.controller.forkserver import ForkedProcess, ForkServer, forkable
from harnessrl.services.controller.runner import (
    LaunchError,
    LaunchSpec,
    Outcome,
    Run,
    RunResult,
    parse_result,
)
from harnessrl.services.controller.sandbox import Sandbox, SandboxedProcess

log = get_logger(__name__)

RunProcess = asyncio.subprocess.Process | ForkedProcess | SandboxedProcess

_TAIL_LINES = 50


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def run_dir(workdir: Path, episode_id: str, attempt: int) -> Path:
    """The working directory of one attempt's run under the controller's `workdir`."""
    return workdir / f"{_safe(episode_id)}-{attempt}"


class LocalRun:
    """One harness process group."""

    def __init__(
        self,
        runner: LocalRunner,
        spec: LaunchSpec | None,
        episode_id: str,
        attempt: int,
        workdir: Path,
    ) -> None:
        self._runner = runner
        self._spec = spec
        self.episode_id = episode_id
        self.attempt = attempt
        self.workdir = workdir
        self.ref = ""
        self._process: RunProcess | None = None
        self._result: RunResult | None = None
        self._done = asyncio.Event()
        self._killed: str | None = None
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._started = time.time()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        assert self._spec is not None
        spec = self._spec
        self.workdir.mkdir(parents=True, exist_ok=True)
        inherited = self._runner.inherited_env()
        env = {**inherited, **spec.env, "HARNESSRL_OUTPUT": str(self.workdir / "result.json")}
        sandbox = self._runner.sandbox
        if sandbox is not None:  # never forked: the fork server runs unsandboxed
            self._process = await sandbox.spawn(
                spec.command, self.workdir, env, gateway_url=spec.gateway_url
            )
        forkserver = await self._runner.forkserver(spec) if sandbox is None else None
        if forkserver is not None:
            try:
                self._process = await forkserver.spawn(spec.command, self.workdir, env)
            except OSError as err:
                log.warning("fork server refused a run; executing it", error=str(err))
        if self._process is None:
            self._process = await self._exec(spec, env)
        self.ref = str(self._process.pid)
        self._runner.record(self)
        self._task = asyncio.create_task(self._follow_or_fail(spec.timeout_s))

    async def _exec(self, spec: LaunchSpec, env: dict[str, str]) -> asyncio.subprocess.Process:
        try:
            return await asyncio.create_subprocess_exec(
                *spec.command,
                cwd=self.workdir,
                env=env,
                start_new_session=True,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as err:
            raise LaunchError(f"cannot start {spec.command[0]!r}: {err}") from err

    def abandoned(self, reason: str) -> None:
        """For a recovered run: it is already over, as far as this controller can know."""
        self._finish(
            RunResult(
                "abandoned",
                None,
                None,
                None,
                reason,
                self.workdir.as_uri(),
                self._started,
                time.time(),
            )
        )

    async def wait(self) -> RunResult:
        await self._done.wait()
        assert self._result is not None
        return self._result

    async def kill(self, reason: str) -> None:
        if self._done.is_set() or self._process is None:
            return
        self._killed = reason
        kill_group(self._process.pid, signal.SIGKILL)
        await self._done.wait()

    async def _follow_or_fail(self, timeout_s: float) -> None:
        """`_follow`; a failure of the runner itself ends the run as an infrastructure error
        (retried) instead of leaving its episode waiting forever."""
        try:
            await self._follow(timeout_s)
        except Exception as err:
            log.exception("following a harness run failed", episode_id=self.episode_id)
            if self._process is not None:
                kill_group(self._process.pid, signal.SIGKILL)
            self._runner.forget(self)
            message = f"the runner failed: {err!r}"
            self._finish(
                RunResult("infra_error", None, None, None, message, "", self._started, time.time())
            )

    async def _follow(self, timeout_s: float) -> None:
        process = self._process
        assert process is not None and process.stdout is not None and process.stderr is not None
        cap = self._runner.log_cap_bytes
        with (
            (self.workdir / "stdout.log").open("wb") as out,
            (self.workdir / "stderr.log").open("wb") as err,
        ):
            readers = asyncio.gather(
                _drain(process.stdout, out, cap, self._tail), _drain(process.stderr, err, cap, None)
            )
            timed_out = False
            try:
                await asyncio.wait_for(process.wait(), timeout_s)
            except TimeoutError:
                timed_out = True
                await terminate_group(process, self._runner.kill_grace_s)
            kill_group(process.pid, signal.SIGKILL)  # leftovers: the harness's children
            try:  # a child that escaped the group may hold the pipes open: do not wait forever
                await asyncio.wait_for(readers, self._runner.kill_grace_s)
            except TimeoutError:
                log.warning(
                    "harness output still open after it ended; stopped reading",
                    episode_id=self.episode_id,
                    attempt=self.attempt,
                )
        self._runner.forget(self)
        output = self.workdir / "result.json"
        data = output.read_bytes() if output.exists() else None
        result_json, error, truncated = parse_result(
            data, "\n".join(self._tail), self._runner.result_cap_bytes
        )
        outcome: Outcome
        if self._killed is not None:
            outcome, message = "abandoned", self._killed
        elif timed_out:
            outcome, message = "timeout", f"killed after its {timeout_s:g} s timeout"
        else:
            outcome, message = "exited", f"exited with code {process.returncode}"
        exit_code = None if outcome != "exited" else process.returncode
        self._finish(
            RunResult(
                outcome,
                exit_code,
                result_json,
                error,
                message,
                self.workdir.as_uri(),
                self._started,
                time.time(),
                truncated,
            )
        )

    def _finish(self, result: RunResult) -> None:
        self._result = result
        self._done.set()


async def _drain(
    stream: asyncio.StreamReader, sink: IO[bytes], cap: int, tail: deque[str] | None
) -> None:
    written = 0
    while line := await stream.readline():
        if written < cap:
            chunk = line[: cap - written]
            sink.write(chunk)
            written += len(chunk)
        if tail is not None:
            tail.append(line.decode("utf-8", "replace").rstrip("\r\n"))


class LocalRunner:
    """Runs harnesses as local process groups; see the module docstring."""

    name = "local"

    def __init__(
        self,
        *,
        workdir: Path,
        state_dir: Path,
        log_cap_bytes: int,
        result_cap_bytes: int,
        kill_grace_s: float,
        inherit_env: list[str],
        sandbox: Sandbox | None = None,
    ) -> None:
        self.inherit_env = inherit_env
        self.sandbox = sandbox
        """Where runs are contained; None: they run unsandboxed."""
        # Absolute: each run's directory is its harness's cwd, and HARNESSRL_OUTPUT and the
        # artifacts URI must name it from anywhere.
        self.workdir = workdir.resolve()
        self.records = state_dir.resolve() / "runs"
        self.log_cap_bytes = log_cap_bytes
        self.result_cap_bytes = result_cap_bytes
        self.kill_grace_s = kill_grace_s
        self._runs: set[LocalRun] = set()
        self._forkservers: dict[tuple[str, ...], ForkServer | None] = {}
        self._forkserver_lock = asyncio.Lock()

    async def start(self) -> None:
        """Make the directories; with a sandbox, check that one can be made here: mode
        bwrap raises LaunchError when it cannot (the controller does not start), mode auto
        goes on unsandboxed, with a warning."""
        self.records.mkdir(parents=True, exist_ok=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.sandbox is None:
            return
        try:
            await self.sandbox.probe()
        except LaunchError as err:
            if self.sandbox.settings.mode == "bwrap":
                raise
            log.warning(
                "controller.sandbox.mode is auto and no sandbox can be made here: local "
                "harness runs are NOT sandboxed",
                reason=str(err),
            )
            await self.sandbox.stop()
            self.sandbox = None

    async def stop(self) -> None:
        """Runs in progress keep running; a restarted controller recovers them."""
        for server in self._forkservers.values():
            if server is not None:
                await server.stop()
        self._forkservers.clear()
        if self.sandbox is not None:
            await self.sandbox.stop()

    async def forkserver(self, spec: LaunchSpec) -> ForkServer | None:
        """The fork server for `spec.preload`, started on first use; None when the spec
        does not ask for one, its command is not `python SCRIPT ...`, or it cannot start."""
        if not spec.preload or not forkable(spec.command):
            return None
        async with self._forkserver_lock:  # runs launched together share one server
            return await self._forkserver(spec.preload)

    async def _forkserver(self, preload: tuple[str, ...]) -> ForkServer | None:
        if preload not in self._forkservers:
            started: ForkServer | None = ForkServer(list(preload), self.inherited_env())
            try:
                await started.start()  # type: ignore[union-attr]
            except (OSError, RuntimeError) as err:
                log.error("fork server failed to start; executing runs", error=str(err))
                started = None
            self._forkservers[preload] = started
        server = self._forkservers[preload]
        return server if server is not None and server.alive else None

    def inherited_env(self) -> dict[str, str]:
        """The variables of the controller's environment that harnesses inherit."""
        return {k: os.environ[k] for k in self.inherit_env if k in os.environ}

    async def launch(self, spec: LaunchSpec) -> Run:
        run = LocalRun(
            self,
            spec,
            spec.episode_id,
            spec.attempt,
            run_dir(self.workdir, spec.episode_id, spec.attempt),
        )
        await run.start()
        self._runs.add(run)
        return run

    async def recover(self) -> list[Run]:
        recovered: list[Run] = []
        for path in sorted(self.records.glob("*.json")):
            try:
                data = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                path.unlink(missing_ok=True)
                continue
            run = LocalRun(self, None, data["episode_id"], data["attempt"], Path(data["workdir"]))
            run.ref = str(data["pid"])
            if group_alive(data["pid"]):
                kill_group(data["pid"], signal.SIGKILL)
                reason = "controller restarted: the run was killed (its outcome is unknowable)"
            else:
                reason = "controller restarted: the run had ended unobserved"
            run.abandoned(reason)
            path.unlink(missing_ok=True)
            log.warning(
                "recovered a run left by a previous controller",
                episode_id=run.episode_id,
                attempt=run.attempt,
                pid=data["pid"],
                reason=reason,
            )
            recovered.append(run)
        return recovered

    def record(self, run: LocalRun) -> None:
        data = {
            "episode_id": run.episode_id,
            "attempt": run.attempt,
            "pid": int(run.ref),
            "workdir": str(run.workdir),
        }
        path = self.records / f"{_safe(run.episode_id)}-{run.attempt}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(orjson.dumps(data))
        os.replace(tmp, path)

    def forget(self, run: LocalRun) -> None:
        (self.records / f"{_safe(run.episode_id)}-{run.attempt}.json").unlink(missing_ok=True)
        self._runs.discard(run)


def local_runner(section: ControllerSection) -> LocalRunner:
    """The local runner the controller's settings describe, sandboxed or not (the one
    place `controller.sandbox.mode` is read)."""
    settings = section.sandbox
    sandbox = None
    if settings.mode == "auto" and shutil.which(settings.bwrap) is None:
        log.warning(
            "controller.sandbox.mode is auto and bwrap is not installed: local harness runs "
            "are NOT sandboxed",
            bwrap=settings.bwrap,
        )
    elif settings.mode != "off":
        sandbox = Sandbox(
            settings,
            gateway_url=section.gateway_url,
            workdir=section.workdir,
            state_dir=section.state_dir,
        )
    return LocalRunner(
        workdir=section.workdir,
        state_dir=section.state_dir,
        log_cap_bytes=section.log_cap_bytes,
        result_cap_bytes=section.result_cap_bytes,
        kill_grace_s=section.kill_grace_s,
        inherit_env=section.inherit_env,
        sandbox=sandbox,
    )
