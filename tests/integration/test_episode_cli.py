"""A harness run by hand against `harnessrl up`: `harnessrl episode open` from the stack file
`up` wrote, one call with the real openai SDK, `harnessrl episode close`, and what that put
on the topics."""

from __future__ import annotations

import asyncio
import json
import shlex
import stat
import sys
from pathlib import Path
from typing import Any

import openai
import pytest

from harnessrl import events
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import events_on
from tests.integration.up_process import start_up

pytestmark = pytest.mark.integration


async def _harnessrl(cwd: Path, *args: str) -> str:
    """Run `harnessrl ARGS` in `cwd` (where a user runs it); its stdout, or fail the test."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "harnessrl", *args,
        cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, f"harnessrl {' '.join(args)}: {err.decode()}"
    return out.decode()


async def _shell(cwd: Path, script: str) -> list[str]:
    process = await asyncio.create_subprocess_exec(
        "bash", "-c", script, cwd=cwd, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0
    return out.decode().splitlines()


async def _one_call(env: dict[str, str]) -> None:
    client = openai.AsyncOpenAI(
        base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"], max_retries=5
    )
    try:
        reply = await client.chat.completions.create(
            model="my-harness-model",
            messages=[{"role": "user", "content": "What is 2 plus 2?"}],
            max_tokens=8,
        )
    finally:
        await client.close()
    assert reply.model == "my-harness-model"
    assert reply.usage is not None and reply.usage.completion_tokens > 0


async def test_an_episode_opened_by_hand_is_served_captured_and_closed(tmp_path: Path) -> None:
    workdir = tmp_path / ".harnessrl"  # `up`'s default name: `episode` finds it from tmp_path
    up = await start_up(workdir)
    try:
        table = await up.table(timeout=120)
        bootstrap = table["broker"][1].removeprefix("kafka ")
        stack_file = workdir / "stack.json"
        assert stat.S_IMODE(stack_file.stat().st_mode) == 0o600
        secrets = json.loads(stack_file.read_text())["gateway"]
        assert any(f"stack file {stack_file}" in line for line in up.lines)

        opened: dict[str, Any] = json.loads(await _harnessrl(tmp_path, "episode", "open", "--json"))
        episode_id, group_id = opened["episode_id"], opened["group_id"]
        assert episode_id == f"{group_id}-manual-0"
        assert (opened["attempt"], opened["mode"]) == (1, "val")
        await _one_call(opened["env"])
        closed = json.loads(await _harnessrl(tmp_path, "episode", "close", episode_id, "--json"))
        assert closed == {
            "episode_id": episode_id,
            "attempt": 1,
            "group_id": group_id,
            "call_count": 1,
        }

        # The shell form, as `eval "$(harnessrl episode open)"` runs it; closed unused.
        script = (
            f'out="$({sys.executable} -m harnessrl episode open --mode train)" && eval "$out" && '
            'printf "%s\\n" "$OPENAI_BASE_URL" "$OPENAI_API_KEY" "$ANTHROPIC_BASE_URL" '
            '"${out##*close it with: }"'
        )
        openai_base, key, anthropic_base, close_command = await _shell(tmp_path, script)
        assert openai_base == f"{anthropic_base}/v1"
        assert anthropic_base == f"{secrets['url']}/e/{key}"
        program, *close_args = shlex.split(close_command)
        assert program == "harnessrl"
        unused = await _harnessrl(tmp_path, *close_args)
        assert unused.strip().endswith("call_count 0")
        again = await _harnessrl(tmp_path, "episode", "close", episode_id)
        assert again.strip().endswith("call_count 1")  # closing again: the same count

        calls = await events_on(bootstrap, events.CALLS)
        mine = [(kind, e) for kind, e in calls if getattr(e, "episode_id", "") == episode_id]
        assert [kind for kind, _ in mine] == ["model_call", "episode_closed"]
        call, close = mine[0][1], mine[1][1]
        assert (call.attempt, call.group_id, call.mode) == (1, group_id, pb.MODE_VAL)
        assert len(call.completion_token_ids) > 0
        assert (close.call_count, close.reason) == (1, "manual")
        episodes = await events_on(bootstrap, events.EPISODES)
        assert not [e for _, e in episodes if e.group_id == group_id]  # nothing to score

        output = "\n".join(up.lines)
        assert secrets["token_secret"] not in output
        assert secrets["admin_token"] not in output
    finally:
        code = await up.stop()
    assert code == 0, "\n".join(up.lines[-40:])
    assert not stack_file.exists()
    assert not (workdir / "manual-episodes.jsonl").exists()
