"""Sandboxed local runs (controller.sandbox.mode: bwrap) through the controller's own local
runner: a hostile harness is contained, reaches the gateway and nothing else, its fork bomb
is stopped; timeouts, kills, recovery and exit codes still hold; a sandbox that cannot be
set up fails the run.

Real processes in real bubblewrap sandboxes, the real embedded broker, a real HTTP server on
loopback as the gateway. Skipped where bwrap is missing or cannot build a sandbox, unless
CI=true, where that is a failure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from harnessrl.broker import EmbeddedBroker
from harnessrl.episode_token import EpisodeClaims, harness_env, mint
from harnessrl.http import HttpServer, Request, Response
from harnessrl.services.controller.config import ControllerSection, SandboxSettings
from harnessrl.services.controller.local import LocalRunner, local_runner
from harnessrl.services.controller.runner import LaunchError, LaunchSpec
from tests.helpers import eventually

pytestmark = pytest.mark.integration

HOSTILE = Path(__file__).resolve().parents[1] / "harnesses" / "hostile_harness.py"
SECRET = b"sandbox-test-secret-0123456789abcdef"
MAX_PROCESSES = 64


@pytest.fixture(autouse=True)
def _bwrap() -> None:
    """Skip (fail under CI=true) where no sandbox can be made."""
    bwrap, reason = shutil.which("bwrap"), None
    if bwrap is None:
        reason = "bwrap is not installed (Debian package bubblewrap; `make test` installs it)"
    else:
        probe = subprocess.run(
            [bwrap, "--ro-bind", "/", "/", "--unshare-all", "true"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if probe.returncode != 0:
            reason = f"bwrap cannot build a sandbox on this machine: {probe.stderr.strip()}"
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


class Gateway:
    """A real HTTP server on loopback standing in for the gateway's harness port."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.server = HttpServer(self._handle, host="127.0.0.1", port=0)

    async def _handle(self, request: Request) -> Response:
        self.requests.append((request.path, request.headers.get("authorization", "")))
        body = orjson.dumps({"object": "list", "data": [{"id": "policy", "object": "model"}]})
        return Response(200, [("content-type", "application/json")], body)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@pytest_asyncio.fixture
async def gateway() -> AsyncIterator[Gateway]:
    gw = Gateway()
    await gw.server.start()
    try:
        yield gw
    finally:
        await gw.server.stop(grace_s=1)


def _section(tmp_path: Path, gateway_url: str, **sandbox: Any) -> ControllerSection:
    settings: dict[str, Any] = {
        "mode": "bwrap",
        "max_processes": MAX_PROCESSES,
        "max_file_bytes": 1024 * 1024,
        # Apart from other test runs on this machine, which would share the process limit.
        "uid_base": 2_000_000_000 + (os.getpid() % 100_000) * 16,
    } | sandbox
    return ControllerSection(
        gateway_url=gateway_url,
        workdir=tmp_path / "host" / "episodes",
        state_dir=tmp_path / "host" / "state",
        kill_grace_s=0.5,
        inherit_env=["PATH", "HOME"],
        sandbox=SandboxSettings(**settings),
    )


def _spec(
    section: ControllerSection,
    command: list[str],
    task: dict[str, Any],
    *,
    episode: str = "g-0",
    timeout_s: float = 30,
) -> tuple[LaunchSpec, str]:
    """The LaunchSpec the controller would build (its token and gateway URLs)."""
    claims = EpisodeClaims(episode, 1, "g", "train", time.time() + 600)
    token = mint(claims, SECRET)
    env = {**harness_env(section.gateway_url, token), "HARNESSRL_TASK": json.dumps(task)}
    return LaunchSpec(episode, 1, "g", "t", tuple(command), env, timeout_s), token


def _script(tmp_path: Path, name: str, code: str) -> Path:
    scripts = tmp_path / "scripts"
    scripts.mkdir(exist_ok=True)
    path = scripts / name
    path.write_text(textwrap.dedent(code))
    path.chmod(0o644)
    return path


def _snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int] | None]:
    """Every file (size, mtime) and directory (None) under `root` but `skip`'s."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if not (p == skip or skip in p.parents)
    }


def _processes_with(marker: str) -> list[int]:
    """Live processes whose command line carries `marker` (zombies are dead)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry))
    return found


@pytest.fixture
def abstract_listener() -> Iterator[str]:
    """A unix socket in the abstract namespace (a host service without a file)."""
    name = f"harnessrl-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind("\0" + name)
        sock.listen()
        yield name


async def _start(runner: LocalRunner, spec: LaunchSpec) -> Any:
    await runner.start()
    return await runner.launch(spec)


def _hostile_task(section: ControllerSection, broker: str, abstract: str) -> dict[str, Any]:
    """The targets of the hostile harness: another run's directory, the controller's state
    (both made here), the repository, the system, the broker, the internet, a host socket."""
    host, workdir, state = section.workdir.parent, section.workdir, section.state_dir
    other_run = workdir / "g-1-1"
    other_run.mkdir(parents=True)
    (other_run / "keep.txt").write_text("another run's work")
    state.mkdir(parents=True)
    (state / "secret.txt").write_text("the controller's")
    broker_host, broker_port = broker.rsplit(":", 1)
    with socket.create_connection((broker_host, int(broker_port)), timeout=3):
        pass  # the broker does listen: what the harness meets is the sandbox
    return {
        "write": [
            str(host / "outside.txt"),
            str(other_run / "planted.txt"),
            str(state / "planted.txt"),
            str(HOSTILE.parent / "planted.txt"),
            "/usr/planted.txt",
        ],
        "delete": [str(other_run / "keep.txt"), str(state / "secret.txt"), str(HOSTILE)],
        "read": [
            str(state / "secret.txt"),
            str(state / "runs" / "g-0-1.json"),
            str(other_run / "keep.txt"),
            f"/proc/{os.getpid()}/environ",
        ],
        "list": [str(workdir), str(host), str(state), str(Path.home().resolve())],
        "connect": [[broker_host, int(broker_port)], ["1.1.1.1", 443]],
        "abstract": abstract,
        "big_file_bytes": 2 * 1024 * 1024,
        "fork_attempts": 8 * MAX_PROCESSES,
    }


def _assert_contained(report: dict[str, Any], section: ControllerSection) -> None:
    """Every hostile attempt failed; the harness saw nothing of the controller's but its own
    run, and none of its processes."""
    for kind in ("writes", "deletes", "reads", "connects"):
        succeeded = [target for target, outcome in report[kind].items() if outcome == "ok"]
        assert not succeeded, f"{kind} that got through: {succeeded}"
    assert report["abstract"] != "ok"
    assert report["big_file"].startswith("EFBIG"), report["big_file"]
    assert report["own_write"] == "ok"
    workdir, home = section.workdir, Path.home().resolve()
    listings = report["listings"]
    assert listings[str(workdir)] == ["g-0-1"]
    assert listings[str(workdir.parent)] == ["episodes"]
    assert listings[str(section.state_dir)] is None
    shown = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix, HOSTILE, workdir)]
    leading = {p.relative_to(home).parts[0] for p in shown if home in p.parents}
    assert set(listings[str(home)] or []) <= leading  # HOME: only the way to what it needs
    controller = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ")
    assert controller.decode() not in report["processes"]
    assert len(report["processes"]) <= 3  # its init, itself (and a child starting)
    if os.geteuid() == 0:
        assert report["uid"] == section.sandbox.uid_base
        assert (workdir / "g-0-1" / "own.txt").stat().st_uid == section.sandbox.uid_base


async def test_a_hostile_harness_reaches_the_gateway_and_nothing_else(
    tmp_path: Path, gateway: Gateway, broker: EmbeddedBroker, abstract_listener: str
) -> None:
    section = _section(tmp_path, gateway.url)
    task = _hostile_task(section, broker.bootstrap, abstract_listener)
    host, run_dir = tmp_path / "host", section.workdir / "g-0-1"
    marker = f"--marker={uuid.uuid4().hex}"
    spec, token = _spec(section, [sys.executable, str(HOSTILE), marker], task, timeout_s=60)
    runner = local_runner(section)
    await runner.start()
    before = _snapshot(host, skip=run_dir)
    try:
        run = await runner.launch(spec)
        result = await run.wait()
    finally:
        await runner.stop()

    assert result.outcome == "exited" and result.exit_code == 0, (
        result.message,
        (run_dir / "stderr.log").read_text(),
    )
    assert result.finished_at - result.started_at < spec.timeout_s
    assert result.result_json is not None
    report = orjson.loads(result.result_json)
    _assert_contained(report, section)
    # From outside: nothing but its own directory changed.
    assert _snapshot(host, skip=run_dir) == before
    assert not (HOSTILE.parent / "planted.txt").exists()
    assert (run_dir / "own.txt").exists()
    # The gateway, through the relay, under the episode's own token.
    assert report["gateway"]["status"] == 200, report["gateway"]
    assert report["gateway"]["body"]["data"][0]["id"] == "policy"
    assert gateway.requests == [(f"/e/{token}/v1/models", f"Bearer {token}")]
    # The fork bomb met the process limit, and everything it made died with the run.
    bomb = report["fork_bomb"]
    assert bomb["refused"] == "EAGAIN", bomb
    assert bomb["processes_seen"] <= MAX_PROCESSES, bomb
    await eventually(lambda: not _processes_with(marker), timeout=5)


async def test_at_its_timeout_a_sandboxed_run_gets_sigterm_then_dies_with_all_it_started(
    tmp_path: Path, gateway: Gateway
) -> None:
    section = _section(tmp_path, gateway.url)
    marker = f"--marker={uuid.uuid4().hex}"
    script = _script(
        tmp_path,
        "stubborn.py",
        f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, lambda *_: open("got-term", "w").close())
        subprocess.Popen(  # a daemon in its own session, as a harness's tool might leave
            [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}],
            start_new_session=True,
        )
        open("started", "w").close()
        while True:
            time.sleep(1)
        """,
    )
    spec, _ = _spec(section, [sys.executable, str(script), marker], {}, timeout_s=1.5)
    runner = local_runner(section)
    try:
        run = await _start(runner, spec)
        result = await run.wait()
    finally:
        await runner.stop()
    run_dir = section.workdir / "g-0-1"
    assert result.outcome == "timeout" and result.exit_code is None, result.message
    assert (run_dir / "started").exists()
    assert (run_dir / "got-term").exists(), "the polite SIGTERM never reached the harness"
    await eventually(lambda: not _processes_with(marker), timeout=5)


async def test_kill_and_a_restarted_controller_end_sandboxed_runs(
    tmp_path: Path, gateway: Gateway
) -> None:
    section = _section(tmp_path, gateway.url)
    marker = f"--marker={uuid.uuid4().hex}"
    script = _script(tmp_path, "sleeper.py", "import time; time.sleep(600)\n")
    first = local_runner(section)
    second = local_runner(section)  # a new controller, same state directory
    try:
        killed = await _start(first, _spec(section, [sys.executable, str(script), marker], {})[0])
        left = await first.launch(
            _spec(section, [sys.executable, str(script), marker], {}, episode="g-3")[0]
        )
        assert len(_processes_with(marker)) >= 6  # bwrap, its init, the harness: twice
        await killed.kill("stale")
        assert (await killed.wait()).outcome == "abandoned"
        await second.start()
        (recovered,) = await second.recover()
        result = await recovered.wait()
        assert (recovered.episode_id, result.outcome) == ("g-3", "abandoned")
        assert "killed" in result.message
        await eventually(lambda: not _processes_with(marker), timeout=5)
        assert (await left.wait()).outcome == "exited"  # as far as the first one saw
    finally:
        await first.stop()
        await second.stop()


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["exec", "preload-ignored"])
async def test_a_sandboxed_crash_reports_its_signal(
    tmp_path: Path, gateway: Gateway, preload: tuple[str, ...]
) -> None:
    section = _section(tmp_path, gateway.url)
    script = _script(
        tmp_path,
        "crash.py",
        """
        import json, os, signal
        json.dump({"pid": os.getpid()}, open(os.environ["HARNESSRL_OUTPUT"], "w"))
        os.kill(os.getpid(), signal.SIGSEGV)
        """,
    )
    spec, _ = _spec(section, [sys.executable, str(script)], {})
    runner = local_runner(section)
    try:
        run = await _start(runner, dataclasses.replace(spec, preload=preload))
        result = await run.wait()
        assert not runner._forkservers  # sandboxed runs are never forked
    finally:
        await runner.stop()
    assert result.outcome == "exited" and result.exit_code == -signal.SIGSEGV, result.message
    assert result.result_json is not None
    assert orjson.loads(result.result_json)["pid"] == 2  # after its init, in its namespace


async def test_a_sandbox_that_cannot_be_set_up_fails_the_launch_naming_the_cause(
    tmp_path: Path, gateway: Gateway
) -> None:
    failing = _script(
        tmp_path, "failing-bwrap", "#!/bin/sh\necho 'bwrap: simulated failure' >&2\nexit 1\n"
    )
    failing.chmod(0o755)
    script = _script(tmp_path, "ok.py", "print('never runs')\n")
    # A controller that cannot make a sandbox at all refuses to start, naming the cause.
    for sandbox, expected in (
        ({"bwrap": "no-such-bwrap"}, "controller.sandbox.bwrap"),
        ({"bwrap": str(failing)}, "simulated failure"),
    ):
        runner = local_runner(_section(tmp_path, gateway.url, **sandbox))
        with pytest.raises(LaunchError, match=re.escape(expected)) as refused:
            await runner.start()
        if "simulated" in expected:
            assert "controller.sandbox.mode: off to run harnesses uncontained" in str(refused.value)
        await runner.stop()
    # mode auto goes on unsandboxed, with a warning
    auto = local_runner(_section(tmp_path, gateway.url, mode="auto", bwrap=str(failing)))
    await auto.start()
    assert auto.sandbox is None
    await auto.stop()
    cases = [
        (
            {"read_only": [str(tmp_path / "missing-venv")]},
            [sys.executable, str(script)],
            "controller.sandbox.read_only",
        ),
        ({}, ["no-such-harness-program"], "'no-such-harness-program': [Errno 2]"),
    ]
    for sandbox, command, expected in cases:
        section = _section(tmp_path, gateway.url, **sandbox)
        runner = local_runner(section)
        await runner.start()
        try:
            with pytest.raises(LaunchError, match=re.escape(expected)):
                await runner.launch(_spec(section, command, {})[0])
        finally:
            await runner.stop()
        assert not list((section.state_dir / "runs").glob("*.json"))
