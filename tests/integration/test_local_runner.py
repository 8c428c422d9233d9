"""The local runner with real harness processes: results, timeouts, crashes, recovery."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import orjson
import pytest

from harnessrl.services.controller.local import LocalRunner
from harnessrl.services.controller.runner import LaunchSpec, RunResult

pytestmark = pytest.mark.integration


def _runner(tmp_path: Path, **kwargs: Any) -> LocalRunner:
    settings: dict[str, Any] = {
        "workdir": tmp_path / "episodes",
        "state_dir": tmp_path / "state",
        "log_cap_bytes": 4096,
        "result_cap_bytes": 1024,
        "kill_grace_s": 0.5,
        "inherit_env": ["PATH", "HOME"],
    } | kwargs
    return LocalRunner(**settings)


def _spec(
    tmp_path: Path,
    code: str,
    *,
    episode: str = "g-0",
    timeout_s: float = 30,
    env: dict[str, str] | None = None,
) -> LaunchSpec:
    script = tmp_path / f"{episode}.py"
    script.write_text(textwrap.dedent(code))
    return LaunchSpec(
        episode,
        1,
        "g",
        "t",
        (sys.executable, str(script)),
        env or {"HARNESSRL_TASK": '{"question": "1+1"}'},
        timeout_s,
    )


async def _run(runner: LocalRunner, spec: LaunchSpec) -> RunResult:
    await runner.start()
    run = await runner.launch(spec)
    return await run.wait()


async def test_a_result_file_and_exit_code_are_reported(tmp_path: Path) -> None:
    result = await _run(
        _runner(tmp_path),
        _spec(
            tmp_path,
            """
        import json, os
        task = json.loads(os.environ["HARNESSRL_TASK"])
        open(os.environ["HARNESSRL_OUTPUT"], "w").write(json.dumps({"asked": task}))
        print('HARNESSRL_RESULT {"ignored": true}')  # the file wins
    """,
        ),
    )
    assert result.outcome == "exited" and result.exit_code == 0
    assert result.result_json is not None
    assert orjson.loads(result.result_json) == {"asked": {"question": "1+1"}}
    assert result.artifacts_uri.startswith("file://")


@pytest.mark.parametrize("preload", [(), ("json",)], ids=["exec", "forkserver"])
async def test_a_relative_workdir_works_for_executed_and_forked_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preload: tuple[str, ...]
) -> None:
    monkeypatch.chdir(tmp_path)
    runner = _runner(tmp_path, workdir=Path("episodes"), state_dir=Path("state"))
    spec = _spec(
        tmp_path,
        """
        import os
        open(os.environ["HARNESSRL_OUTPUT"], "w").write('{"cwd": "%s"}' % os.getcwd())
    """,
    )
    try:
        result = await _run(runner, dataclasses.replace(spec, preload=preload))
    finally:
        await runner.stop()
    assert result.outcome == "exited" and result.exit_code == 0, result.message
    assert result.result_json is not None
    assert orjson.loads(result.result_json) == {"cwd": str(tmp_path / "episodes" / "g-0-1")}
    assert result.artifacts_uri == (tmp_path / "episodes" / "g-0-1").as_uri()


async def test_the_last_stdout_line_may_carry_the_result(tmp_path: Path) -> None:
    result = await _run(
        _runner(tmp_path),
        _spec(
            tmp_path,
            """
        print("working...")
        print('HARNESSRL_RESULT {"answer": 42}')
        raise SystemExit(3)
    """,
        ),
    )
    assert result.exit_code == 3
    assert result.result_json is not None and orjson.loads(result.result_json) == {"answer": 42}


async def test_a_malformed_result_is_reported_as_such(tmp_path: Path) -> None:
    result = await _run(
        _runner(tmp_path),
        _spec(
            tmp_path,
            """
        print('HARNESSRL_RESULT {"answer": 4')
    """,
        ),
    )
    assert result.result_json is None
    assert result.result_error is not None
    assert "malformed result in HARNESSRL_RESULT line" in result.result_error


async def test_a_hanging_harness_is_killed_at_its_timeout_with_its_children(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "child.pid"
    spec = _spec(
        tmp_path,
        f"""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignores the polite request too
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pidfile)!r}, "w").write(str(child.pid))
        time.sleep(600)
    """,
        timeout_s=1.5,
    )
    result = await _run(_runner(tmp_path), spec)
    assert result.outcome == "timeout" and result.exit_code is None
    child = int(pidfile.read_text())
    await asyncio.sleep(0.2)
    assert not _alive(child), "the harness's child outlived the episode"


async def test_a_crash_reports_the_signal(tmp_path: Path) -> None:
    result = await _run(
        _runner(tmp_path),
        _spec(
            tmp_path,
            """
        import os, signal
        os.kill(os.getpid(), signal.SIGSEGV)
    """,
        ),
    )
    assert result.outcome == "exited" and result.exit_code == -signal.SIGSEGV


async def test_logs_are_capped_and_the_result_line_still_read(tmp_path: Path) -> None:
    result = await _run(
        _runner(tmp_path),
        _spec(
            tmp_path,
            """
        import sys
        for i in range(20000):
            print("x" * 50)
            print("y" * 50, file=sys.stderr)
        print('HARNESSRL_RESULT {"ok": true}')
    """,
        ),
    )
    workdir = tmp_path / "episodes" / "g-0-1"
    assert (workdir / "stdout.log").stat().st_size == 4096
    assert (workdir / "stderr.log").stat().st_size == 4096
    assert result.result_json is not None and orjson.loads(result.result_json) == {"ok": True}


async def test_the_harness_sees_its_environment_and_none_of_the_controllers_secrets(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HARNESSRL_CONTROLLER__TOKEN_SECRET", "do-not-leak-0123456789abcdef-0123")
    monkeypatch.setenv("HARNESSRL_GATEWAY__ADMIN_TOKEN", "do-not-leak-either-0123456789abcdef")
    result = await _run(
        _runner(tmp_path),
        _spec(
            tmp_path,
            """
        import json, os
        print("HARNESSRL_RESULT " + json.dumps(dict(os.environ)))
    """,
            env={"OPENAI_BASE_URL": "http://gw/e/tok/v1", "OPENAI_API_KEY": "tok"},
        ),
    )
    assert result.result_json is not None
    seen = orjson.loads(result.result_json)
    assert seen["OPENAI_BASE_URL"] == "http://gw/e/tok/v1"
    assert seen["HARNESSRL_OUTPUT"].endswith("result.json")
    assert "do-not-leak" not in result.result_json
    assert set(seen) <= {
        "PATH",
        "HOME",
        "OPENAI_BASE_URL",
        "OPENAI_API_KEY",
        "HARNESSRL_OUTPUT",
        "LC_CTYPE",
        "PWD",
        "SHLVL",
        "_",
    }


async def test_kill_ends_a_run_as_abandoned(tmp_path: Path) -> None:
    runner = _runner(tmp_path)
    await runner.start()
    run = await runner.launch(_spec(tmp_path, "import time; time.sleep(600)"))
    await run.kill("stale")
    result = await run.wait()
    assert result.outcome == "abandoned" and result.message == "stale"


async def test_a_restarted_controller_recovers_and_ends_the_runs_left_behind(
    tmp_path: Path,
) -> None:
    first = _runner(tmp_path)
    await first.start()
    run = await first.launch(_spec(tmp_path, "import time; time.sleep(600)", episode="g-3"))
    pid = int(run.ref)
    assert (tmp_path / "state" / "runs" / "g-3-1.json").exists()
    second = _runner(tmp_path)  # a new controller process, same state directory
    await second.start()
    (recovered,) = await second.recover()
    result = await recovered.wait()
    assert (recovered.episode_id, recovered.attempt, result.outcome) == ("g-3", 1, "abandoned")
    assert "controller restarted" in result.message
    await asyncio.sleep(0.2)
    assert not _alive(pid)
    assert not list((tmp_path / "state" / "runs").glob("*.json"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead, merely unreaped
        return f.read().split(")")[-1].split()[0] != "Z"
