"""The controller's fork server: a forked run behaves as `python SCRIPT` would."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from harnessrl.services.controller.forkserver import ForkServer, forkable

SCRIPT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "env": dict(os.environ), "json_loaded": "json" in sys.modules,
                  "proc_environ": open("/proc/self/environ", "rb").read().decode()}))
sys.exit(int(os.environ.get("EXIT", "0")))
"""


def test_forkable_takes_only_python_script_commands() -> None:
    assert forkable(("python", "/x/harness.py", "--flag"))
    assert forkable(("/usr/bin/python3", "harness.py"))
    assert not forkable(("python", "-u", "harness.py"))
    assert not forkable(("node", "harness.js"))
    assert not forkable(("python",))


async def _output(process: object) -> tuple[bytes, bytes]:
    out = await process.stdout.read()  # type: ignore[attr-defined]
    err = await process.stderr.read()  # type: ignore[attr-defined]
    return out, err


async def test_a_forked_run_has_its_own_argv_cwd_env_session_and_exit_code(
    tmp_path: Path,
) -> None:
    script = tmp_path / "harness.py"
    script.write_text(SCRIPT)
    workdir = tmp_path / "run"
    workdir.mkdir()
    os.environ["HARNESSRL_TEST_SECRET"] = "controller-only"
    server = ForkServer(["json"], {"PATH": os.environ["PATH"]})
    await server.start()
    try:
        process = await server.spawn(
            ("python", str(script), "a", "b"), workdir, {"EXIT": "3", "ONLY": "this"}
        )
        out, _ = await _output(process)
        assert await process.wait() == 3
        import json

        seen = json.loads(out)
        assert seen["argv"] == [str(script), "a", "b"]
        assert seen["cwd"] == str(workdir)
        assert seen["path0"] == str(tmp_path)
        assert seen["env"] == {"EXIT": "3", "ONLY": "this"}  # nothing of the controller's
        # The environment block the process started with is the server's: still none of it.
        assert "controller-only" not in seen["proc_environ"]
        assert "PATH=" in seen["proc_environ"]
        assert seen["json_loaded"]
    finally:
        del os.environ["HARNESSRL_TEST_SECRET"]
        await server.stop()


async def test_a_crash_is_exit_1_with_a_traceback_and_a_kill_is_reported(
    tmp_path: Path,
) -> None:
    crash = tmp_path / "crash.py"
    crash.write_text("raise ValueError('boom')\n")
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    server = ForkServer([], {})
    await server.start()
    try:
        process = await server.spawn(("python", str(crash)), tmp_path, {})
        _, err = await _output(process)
        assert await process.wait() == 1
        assert b"ValueError: boom" in err
        process = await server.spawn(("python", str(sleeper)), tmp_path, {})
        assert await process.stdout.readline() == b"up\n"
        assert os.getpgid(process.pid) == process.pid  # its own session and group
        os.killpg(process.pid, signal.SIGKILL)
        assert await asyncio.wait_for(process.wait(), 10) == -signal.SIGKILL
        runs = [await server.spawn(("python", str(crash)), tmp_path, {}) for _ in range(5)]
        codes = await asyncio.gather(*(r.wait() for r in runs))
        assert codes == [1] * 5
    finally:
        await server.stop()


async def test_a_dead_server_refuses_new_runs(tmp_path: Path) -> None:
    server = ForkServer([], {})
    await server.start()
    await server.stop()
    with pytest.raises(OSError):
        await server.spawn(("python", str(tmp_path / "x.py")), tmp_path, {})
