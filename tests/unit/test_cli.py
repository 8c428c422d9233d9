"""The command line: instant help, and the commands that need no broker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _harnessrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harnessrl.apps.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )


def test_help_imports_nothing_heavy() -> None:
    code = (
        "import sys, harnessrl.apps.cli as c; c.build_parser().format_help();"
        "heavy = [m for m in ('torch', 'aiokafka', 'opentelemetry', 'grpc', 'transformers',"
        " 'pydantic') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_help_lists_the_commands() -> None:
    result = _harnessrl("--help")
    assert result.returncode == 0
    for command in ("broker", "submit", "events", "config", "bench"):
        assert command in result.stdout


def test_config_show_prints_the_effective_config_with_secrets_masked() -> None:
    import os

    env = {
        **os.environ,
        "HARNESSRL_KAFKA__SASL_PASSWORD": "hunter2",
        "HARNESSRL_BROKER__LISTEN_PORT": "19999",
    }
    result = _harnessrl("config", "show", "broker", env=env)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["broker"]["listen_port"] == 19999
    assert shown["kafka"]["sasl_password"] == "**********"
    assert "hunter2" not in result.stdout


def test_bad_config_is_one_clear_error_line() -> None:
    import os

    env = {**os.environ, "HARNESSRL_KAFKA__PARTITIONS": "zero"}
    result = _harnessrl("config", "show", "broker", env=env)
    assert result.returncode == 2
    assert "kafka.partitions" in result.stderr
    assert "Traceback" not in result.stderr


def test_submit_refuses_a_bad_file_before_connecting(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"task_id": "a", "input": 1, "split": "train"}\n'
        '{"task_id": "b", "input": 1, "split": "nope"}\n'
    )
    result = _harnessrl("submit", str(path), "--bootstrap", "127.0.0.1:1")
    assert result.returncode == 2
    assert f"{path}:2: field 'split'" in result.stderr
    assert "nothing was submitted" in result.stderr


def test_progress_off_a_terminal_is_a_few_lines_and_a_final_one() -> None:
    import io

    from harnessrl.command import Progress

    stream = io.StringIO()
    progress = Progress("submit", 1000, stream)
    for done in range(1, 1001):
        progress.update(done)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1  # everything happened within a second: only the final line
    assert lines[-1].startswith("submit [##############################] 1000/1000")
