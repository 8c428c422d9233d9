"""`harnessrl up` as a user runs it: the whole stack from one command, one episode through
it, then Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import httpx
import pytest

from harnessrl import events
from tests.helpers import eventually, read_topic, topic_size
from tests.integration.up_process import SERVICES, start_up

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "tasks" / "sample.jsonl"


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc, by parent pid)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


async def _finished_episodes(bootstrap: str) -> list[object]:
    size = await topic_size(bootstrap, events.EPISODES)
    records = await read_topic(bootstrap, events.EPISODES, size) if size else []
    envelopes = [events.decode(events.EPISODES, r.value) for r in records]
    return [e.episode_finished for e in envelopes if e.WhichOneof("event") == "episode_finished"]


async def test_up_starts_every_service_runs_an_episode_and_stops_cleanly_on_ctrl_c(
    tmp_path: Path,
) -> None:
    up = await start_up(tmp_path / "up")
    process = up.process
    try:
        table = await up.table(timeout=120)
        assert list(table) == SERVICES
        async with httpx.AsyncClient(timeout=5) as client:
            for name, (_, _, health) in table.items():
                response = await client.get(health)
                assert response.status_code == 200, (name, response.text)
        children = {pid for pid, _, _ in table.values()}
        assert children <= _descendants(process.pid)
        bootstrap = table["broker"][1].removeprefix("kafka ")
        stack = json.loads((tmp_path / "up" / "stack.json").read_text())
        assert stack["bootstrap"] == bootstrap
        assert stack["services"]["trainer"]["url"] + "/healthz" == table["trainer"][2]

        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(SAMPLE.read_text().splitlines()[2] + "\n")  # one train task
        submit = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "harnessrl", "submit", str(tasks), "--bootstrap", bootstrap,
            cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await submit.communicate()
        assert submit.returncode == 0, err.decode()

        async def finished() -> bool:
            return bool(await _finished_episodes(bootstrap))

        await eventually(finished, timeout=60, interval=0.5)
        everything = children | _descendants(process.pid)

        process.send_signal(signal.SIGINT)
        assert await up.finish(timeout=60) == 0, "\n".join(up.lines[-40:])
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    log = "\n".join(up.lines)
    for name in SERVICES:
        assert f"{name} exited code=0" in log
    stop_order = [line.split()[2] for line in up.lines if line.split()[1:2] == ["stopping"]]
    assert stop_order == SERVICES[::-1]
    assert not [pid for pid in everything if _alive(pid)]
    assert (tmp_path / "up" / "traces.jsonl").stat().st_size > 0
    assert not (tmp_path / "up" / "stack.json").exists()
