"""Learning from production end to end: `harnessrl up` on a production config (no
controller, no tasks), two apps on their own SDKs (openai and anthropic) with one base URL
and their app keys, feedback sent after each session ended, and the trainer's step journal
showing every session's samples trained exactly once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from harnessrl import events
from harnessrl.apps.up.plan import UpError, build_plan
from harnessrl.production import key_digest
from harnessrl.services.trainer.journal import lineage, read, trained_twice
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import events_on, eventually
from tests.integration.up_process import start_up

pytestmark = pytest.mark.integration

DESK_KEY = "hrl-test-desk-key-0123456789abcdef"
IDE_KEY = "hrl-test-ide-key-0123456789abcdef0"
CONFIG = f"""
log: {{level: INFO}}
consumer: {{session_timeout_ms: 6000, heartbeat_interval_ms: 1000}}
inference: {{model: examples/tiny-model, device: cpu, max_batch: 8, default_max_tokens: 8}}
production:
  apps:
    - {{name: desk, key_sha256: {key_digest(DESK_KEY)}, exploration: 1.0}}
    - {{name: ide, key_sha256: {key_digest(IDE_KEY)}, exploration: 1.0}}
  feedback:
    signals: {{thumbs: {{min: -1, max: 1, required: true}}}}
    window_s: 600
reward: {{feedback_sweep_s: 0.5}}
sample_builder: {{tokenizer: examples/tiny-model}}
trainer:
  model: examples/tiny-model
  device: cpu
  dtype: float32
  batch_groups: 2
  checkpoint_every: 1
"""
QUESTION = "What is 17 + 25?"


def test_up_plans_a_production_stack_without_a_controller_and_gives_feedback_a_port(
    tmp_path: Path,
) -> None:
    config = tmp_path / "production.yaml"
    config.write_text(CONFIG)
    plan = build_plan(config, tmp_path, "http://127.0.0.1:4317")
    env = {spec.name: spec.env for spec in plan.children}
    assert list(env) == ["broker", "inference", "gateway", "reward", "sample-builder", "trainer"]
    port = env["reward"]["HARNESSRL_REWARD__FEEDBACK_PORT"]
    assert plan.feedback_url == f"http://127.0.0.1:{port}"
    assert {e["HARNESSRL_PRODUCTION__STORE"] for e in env.values()} == {str(tmp_path / "sessions")}
    bare = tmp_path / "bare.yaml"
    bare.write_text(CONFIG.partition("production:")[0])  # neither a harness nor an app
    with pytest.raises(UpError, match=r"controller\.harness is not set"):
        build_plan(bare, tmp_path, "http://127.0.0.1:4317")


async def _openai_session(gateway: str, session: str) -> None:
    """The desk's session: two calls under one base URL, its session in a header, then
    the end route."""
    client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=DESK_KEY, max_retries=2)
    headers = {"x-harnessrl-session": session, "x-harnessrl-kind": "sum"}
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    for _ in range(2):
        response = await client.chat.completions.create(
            model="desk-bot", messages=messages, max_tokens=8, extra_headers=headers
        )
        messages += [response.choices[0].message.model_dump(include={"role", "content"})]
        messages += [{"role": "user", "content": "Are you sure?"}]
    async with httpx.AsyncClient() as http:
        ended = await http.post(
            f"{gateway}/sessions/{session}/end", headers={"authorization": f"Bearer {DESK_KEY}"}
        )
    assert ended.status_code == 200, ended.text
    assert ended.json()["call_count"] == 2


async def _anthropic_session(gateway: str, session: str) -> None:
    """The IDE's session: its id and kind in the base URL, one call ending it (the header)."""
    client = anthropic.AsyncAnthropic(
        base_url=f"{gateway}/k/review/s/{session}", api_key=IDE_KEY, max_retries=2
    )
    await client.messages.create(
        model="ide-bot",
        max_tokens=8,
        messages=[{"role": "user", "content": QUESTION}],
        extra_headers={"x-harnessrl-session-end": "true"},
    )


async def test_sessions_of_two_sdks_with_feedback_after_their_end_train_exactly_once(
    tmp_path: Path,
) -> None:
    config = tmp_path / "production.yaml"
    config.write_text(CONFIG)
    workdir = tmp_path / "up"
    up = await start_up(workdir, str(config))
    try:
        table = await up.table(timeout=120)
        assert "controller" not in table  # traffic alone: no tasks, no controller
        assert "(feedback API)" in table["reward"][1]
        stack = json.loads((workdir / "stack.json").read_text())
        gateway, feedback = stack["gateway"]["url"], stack["feedback_url"]
        sessions = {"desk": ["t-1", "t-2"], "ide": ["pr-1", "pr-2"]}
        for session in sessions["desk"]:
            await _openai_session(gateway, session)
        for session in sessions["ide"]:
            await _anthropic_session(gateway, session)

        async with httpx.AsyncClient(base_url=feedback, timeout=30) as http:
            for app, key in (("desk", DESK_KEY), ("ide", IDE_KEY)):
                auth = {"authorization": f"Bearer {key}"}

                async def ended(session: str, auth: dict[str, str] = auth) -> bool:
                    shown = await http.get(f"/v1/sessions/{session}", headers=auth)
                    return shown.status_code == 200 and shown.json()["ended_at"] is not None

                for value, session in zip((1.0, -1.0), sessions[app], strict=True):
                    await eventually(lambda s=session: ended(s), timeout=30, interval=0.2)
                    body = {"session": session, "name": "thumbs", "value": value}
                    sent = await http.post("/v1/feedback", json=body, headers=auth)
                    assert sent.status_code == 202, sent.text
                    shown = (await http.get(f"/v1/sessions/{session}", headers=auth)).json()
                    assert shown["signals"][0]["received_at"] > shown["ended_at"]

        groups = {f"s.{app}.{s}" for app, ids in sessions.items() for s in ids}
        journal = workdir / "trainer" / "steps.jsonl"

        def trained() -> dict[str, int]:
            """Steps of the current weights that hold each session's samples."""
            count = dict.fromkeys(groups, 0)
            for step in lineage(read(journal)):
                for group in {s.split("/")[0] for s in step.samples} & groups:
                    count[group] += 1
            return count

        await eventually(lambda: all(trained().values()), timeout=90, interval=0.5)
        assert trained() == dict.fromkeys(groups, 1)
        assert trained_twice(read(journal)) == []

        async def named() -> list[str]:
            """The sessions the announced versions name (a step is journaled before its
            version is announced)."""
            versions = [e for _, e in await events_on(stack["bootstrap"], events.POLICY)]
            return sorted(
                g for v in versions if isinstance(v, pb.PolicyVersion) for g in v.session_groups
            )

        async def all_named() -> bool:
            return set(await named()) >= groups

        await eventually(all_named, timeout=60, interval=0.5)
        assert await named() == sorted(groups)
    finally:
        code = await up.stop()
    assert code == 0, "\n".join(up.lines[-40:])
