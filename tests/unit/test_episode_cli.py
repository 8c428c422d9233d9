"""`harnessrl episode open|close`: arguments, help, the shell output, and the errors a user
sees before any episode exists (no stack, a stale stack, an episode it does not know)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from harnessrl.apps.cli import build_parser, main
from harnessrl.apps.cli.episode import shell_exports
from harnessrl.apps.up.manual_episodes import ManualEpisode
from harnessrl.apps.up.stackfile import STACK_FILE, GatewayAccess, write_stack_file
from harnessrl.broker import free_port

OPEN_FLAGS = ["--mode", "--stack", "--group", "--ttl", "--json"]
CLOSE_FLAGS = ["--attempt", "--group", "--stack", "--reason", "--json"]


def _help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _fails(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one-line error of a command that must fail with exit code 2."""
    try:
        code = main(list(argv))
    except SystemExit as done:  # argparse's own errors
        code = int(done.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def _stack(tmp_path: Path) -> Path:
    """A stack file naming a gateway that is not there (a port nothing listens on)."""
    url = f"http://127.0.0.1:{free_port()}"
    path = tmp_path / STACK_FILE
    write_stack_file(path, {}, GatewayAccess(url, url, "s" * 43, "a" * 43))
    return path


def test_open_and_close_help_list_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, "episode", "open")
    for flag in OPEN_FLAGS:
        assert re.search(rf"(?<![\w-]){flag}(?![\w-])", text), flag
    assert "hrl.episodes" in text  # what it does not publish, and why
    text = _help(capsys, "episode", "close")
    for flag in CLOSE_FLAGS:
        assert re.search(rf"(?<![\w-]){flag}(?![\w-])", text), flag
    assert "EPISODE_ID" in text
    assert "episode" in build_parser().format_help()


def test_open_defaults_to_a_val_token_for_an_hour() -> None:
    args = build_parser().parse_args(["episode", "open"])
    assert (args.mode, args.ttl, args.group, args.stack, args.json) == (
        "val",
        3600.0,
        None,
        None,
        False,
    )
    args = build_parser().parse_args(["episode", "close", "g-1-manual-0"])
    assert (args.episode_id, args.attempt, args.group, args.reason) == (
        "g-1-manual-0",
        None,
        None,
        "manual",
    )


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["episode", "open", "--mode", "test"], "--mode"),
        (["episode", "open", "--ttl", "0"], "--ttl"),
        (["episode", "open", "--ttl", "-5"], "--ttl"),
        (["episode", "open", "--ttl", "inf"], "--ttl"),
        (["episode", "open", "--ttl", "soon"], "--ttl"),
        (["episode", "open", "--group", "a/b"], "--group"),
        (["episode", "open", "--group", ""], "--group"),
        (["episode", "close", "../admin/pause"], "EPISODE_ID"),
        (["episode", "close", "g-1-0", "--attempt", "0"], "--attempt"),
        (["episode", "close"], "EPISODE_ID"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    assert named in _fails(capsys, *argv)


def test_without_a_stack_file_it_says_to_start_up_or_pass_stack(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for argv in (["episode", "open"], ["episode", "close", "g-1-manual-0"]):
        err = _fails(capsys, *argv)
        assert err.count("\n") == 1
        assert ".harnessrl/stack.json" in err
        assert "harnessrl up" in err and "--stack" in err
    err = _fails(capsys, "episode", "open", "--stack", str(tmp_path / "other.json"))
    assert "other.json" in err


def test_a_stale_stack_file_fails_at_open_not_at_the_first_call(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stack = _stack(tmp_path)
    err = _fails(capsys, "episode", "open", "--stack", str(stack))
    assert "cannot be reached" in err and "harnessrl up" in err
    assert "s" * 43 not in err
    assert not (tmp_path / "manual-episodes.jsonl").exists()  # nothing was opened


def test_closing_an_episode_open_did_not_make_needs_its_group(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stack = _stack(tmp_path)
    err = _fails(capsys, "episode", "close", "g-1-0", "--stack", str(stack))
    assert "--group" in err and "g-1-0" in err


def test_shell_exports_set_the_four_variables_and_name_the_close_command(
    tmp_path: Path,
) -> None:
    env = {
        "OPENAI_BASE_URL": "http://127.0.0.1:1/e/t.k/v1",
        "OPENAI_API_KEY": "t.k",
        "ANTHROPIC_BASE_URL": "http://127.0.0.1:1/e/t.k",
        "ANTHROPIC_API_KEY": "t.k",
    }
    episode = ManualEpisode("g-1-manual-0", 1, "g-1", "val", 0.0)
    stack = tmp_path / "my stack" / STACK_FILE
    text = shell_exports(env, episode, stack)
    script = f'{text}\nprintf \'%s\\n\' "$OPENAI_BASE_URL" "$ANTHROPIC_API_KEY"'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [env["OPENAI_BASE_URL"], env["ANTHROPIC_API_KEY"]]
    comment = text.splitlines()[-1]
    assert comment.startswith("# episode g-1-manual-0 (attempt 1, group g-1, mode val")
    close = shlex.split(comment.split("close it with: ", 1)[1])
    assert close == ["harnessrl", "episode", "close", "g-1-manual-0", "--stack", str(stack)]
    assert "--stack" not in shell_exports(env, episode, None)
