"""`harnessrl inference --model examples/tiny-model` as a user starts it, driven by `openai`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from harnessrl.broker import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harnessrl",
            "inference",
            "--model",
            "examples/tiny-model",
            "--port",
            str(port),
            "--no-follow-policy",
        ],
        cwd=ROOT,
        env={**os.environ, "HARNESSRL_LOG__FORMAT": "text"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        try:
            if httpx.get(f"{base}/healthz").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    try:
        yield f"{base}/v1"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0


def test_the_cli_engine_serves_the_openai_sdk(engine: str) -> None:
    client = openai.OpenAI(base_url=engine, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-model"]
    request = {
        "model": "tiny-model",
        "tools": TOOLS,
        "seed": 11,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "extra_body": {"return_token_ids": True},
    }
    whole = client.chat.completions.create(logprobs=True, **request).model_dump()
    streamed = [c.model_dump() for c in client.chat.completions.create(stream=True, **request)]
    ids = [i for c in streamed for ch in c["choices"] for i in (ch.get("token_ids") or [])]
    assert ids == whole["choices"][0]["token_ids"]
    assert len(whole["choices"][0]["logprobs"]["content"]) == len(ids)
    completion = client.completions.create(
        model="tiny-model", prompt=[5, 6, 7], max_tokens=4, extra_body={"return_token_ids": True}
    )
    assert completion.model_dump()["choices"][0]["prompt_token_ids"] == [5, 6, 7]
    health = httpx.get(engine.removesuffix("/v1") + "/healthz").json()
    assert health == {"status": "ok", "checks": {"model_loaded": True, "engine_loop": True}}


def test_the_cli_refuses_a_missing_model_directory() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "harnessrl", "inference", "--model", "/nonexistent"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--model: /nonexistent is not a directory" in result.stderr
