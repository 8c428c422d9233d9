"""Data a user takes back, end to end: `harnessrl up` on a production config with body
capture on; one session deleted before it trained (never trained, the answer says so), one
after (the answer names the version); then a unique marker from each session's body is in
no file the stack keeps (spill logs, session stores, checkpoints, logs, traces)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from harnessrl.production import key_digest
from harnessrl.services.trainer.journal import lineage, read
from tests.helpers import eventually
from tests.integration.up_process import start_up

pytestmark = pytest.mark.integration

KEY = "hrl-test-forget-key-0123456789abcdef"
OTHER = "hrl-test-other-key-0123456789abcdef"
CONFIG = f"""
log: {{level: INFO}}
consumer: {{session_timeout_ms: 6000, heartbeat_interval_ms: 1000}}
inference: {{model: examples/tiny-model, device: cpu, max_batch: 8, default_max_tokens: 8}}
gateway: {{capture_bodies: true}}
production:
  apps:
    - {{name: desk, key_sha256: {key_digest(KEY)}, exploration: 1.0}}
    - {{name: other, key_sha256: {key_digest(OTHER)}, exploration: 1.0}}
  feedback:
    signals: {{thumbs: {{min: -1, max: 1, required: true}}}}
    window_s: 600
reward: {{feedback_sweep_s: 0.5, delete_wait_s: 60}}
sample_builder: {{tokenizer: examples/tiny-model}}
trainer:
  model: examples/tiny-model
  device: cpu
  dtype: float32
  batch_groups: 1
  checkpoint_every: 1
"""


async def _session(gateway: str, session: str, marker: str) -> str:
    """One Responses call (stored by the gateway) carrying `marker`, then the end."""
    client = openai.AsyncOpenAI(base_url=f"{gateway}/s/{session}/v1", api_key=KEY, max_retries=2)
    response = await client.responses.create(
        model="desk-bot", input=f"My account number is {marker}.", max_output_tokens=8
    )
    async with httpx.AsyncClient() as http:
        ended = await http.post(
            f"{gateway}/sessions/{session}/end", headers={"authorization": f"Bearer {KEY}"}
        )
    assert ended.status_code == 200, ended.text
    return response.id


def _holding(root: Path, marker: bytes) -> list[str]:
    return [
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.is_file() and marker in p.read_bytes()
    ]


async def test_a_deleted_session_is_never_trained_or_names_its_version_and_leaves_no_trace(
    tmp_path: Path,
) -> None:
    config = tmp_path / "production.yaml"
    config.write_text(CONFIG)
    workdir = tmp_path / "up"
    up = await start_up(workdir, str(config))
    early, late = b"zq-early-7731-marker", b"zq-late-4490-marker"
    try:
        await up.table(timeout=120)
        stack = json.loads((workdir / "stack.json").read_text())
        gateway, feedback = stack["gateway"]["url"], stack["feedback_url"]
        auth = {"authorization": f"Bearer {KEY}"}
        await _session(gateway, "early", early.decode())
        await _session(gateway, "late", late.decode())
        async with httpx.AsyncClient(base_url=feedback, timeout=90) as http:

            async def known(session: str) -> bool:
                shown = await http.get(f"/v1/sessions/{session}", headers=auth)
                return shown.status_code == 200 and shown.json()["ended_at"] is not None

            await eventually(lambda: known("early"), timeout=30, interval=0.2)
            # Waiting for feedback, the session's body is on disk (the sample builder's store).
            await eventually(lambda: bool(_holding(workdir, early)), timeout=30, interval=0.5)
            await eventually(lambda: known("late"), timeout=30, interval=0.2)
            # Another app's key reaches nothing of this one's sessions.
            foreign = {"authorization": f"Bearer {OTHER}"}
            assert (await http.delete("/v1/sessions/early", headers=foreign)).status_code == 404
            # Deleted before any feedback: never trained.
            gone = await http.delete("/v1/sessions/early", headers=auth)
            assert gone.status_code == 200, gone.text
            assert gone.json()["trained"] is False and gone.json()["trained_versions"] == []
            signal = {"session": "early", "name": "thumbs", "value": 1}
            assert (await http.post("/v1/feedback", json=signal, headers=auth)).status_code == 409
            # The other is trained, then deleted: the answer names the version.
            signal = {"session": "late", "name": "thumbs", "value": 1}
            assert (await http.post("/v1/feedback", json=signal, headers=auth)).status_code == 202
            journal = workdir / "trainer" / "steps.jsonl"

            def trained(session: str) -> list[int]:
                return [
                    step.version
                    for step in lineage(read(journal))
                    if any(s.startswith(f"s.desk.{session}/") for s in step.samples)
                ]

            await eventually(lambda: bool(trained("late")), timeout=120, interval=0.5)
            gone = await http.delete("/v1/sessions/late", headers=auth)
            assert gone.status_code == 200, gone.text
            assert gone.json()["trained"] is True
            assert gone.json()["trained_versions"] == trained("late")
        assert trained("early") == []

        def clean() -> bool:
            return not _holding(workdir, early) and not _holding(workdir, late)

        await eventually(clean, timeout=60, interval=1.0)
    finally:
        code = await up.stop()
    assert code == 0, "\n".join(up.lines[-40:])
    assert _holding(workdir, early) == [] and _holding(workdir, late) == []
