"""The engine fuzzed from the OpenAPI document it serves, on the tiny model, over loopback."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.helpers import FULL
from tests.integration.fuzzing import fuzz, openai_error_shape, summary
from tests.integration.test_inference_api import start_engine
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration

EXAMPLES = 100 if FULL else 40
"""Requests per operation and generation mode (positive, negative); `make test-full` runs
the long version."""


async def test_no_generated_request_gets_a_5xx_and_every_error_is_openai_shaped() -> None:
    # A short context keeps the valid requests that generate cheap on CPU.
    service, task = await start_engine(TINY, max_model_len=96)
    base = f"http://127.0.0.1:{service.port}"
    try:
        async with httpx.AsyncClient() as http:
            served = (await http.get(f"{base}/v1/models")).json()["data"][0]["id"]

        def prepare(case: Any, flip: bool) -> None:
            # Half of the bodies name the served model and give each message content, so
            # that they reach the chat template and generation rather than all stopping at
            # "no such model" or "a user message needs content".
            # Their budgets are kept inside the 96-token context too: a generated prompt or
            # max_tokens past it is (rightly) a 400, and one run could otherwise have no
            # completions request that generates at all.
            if flip and isinstance(case.body, dict):
                body = case.body
                body["model"] = served
                for message in body.get("messages") or ():
                    if isinstance(message, dict) and message.get("content") is None:
                        message["content"] = "hi"
                if "prompt" in body:
                    body["prompt"] = _short(body["prompt"])
                for budget in ("max_tokens", "max_completion_tokens"):
                    if isinstance(body.get(budget), int) and body[budget] > 16:
                        body[budget] = 16

        seen = await asyncio.to_thread(
            fuzz,
            f"{base}/openapi.json",
            base,
            examples=EXAMPLES,
            error_shape=openai_error_shape,
            prepare=prepare,
        )
        print(summary(seen))
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{base}/healthz")).status_code == 200
            answer = await http.post(
                f"{base}/v1/completions",
                json={"model": served, "prompt": "1 + 1 =", "max_tokens": 4},
            )
            assert answer.status_code == 200, answer.text
        generating = [k for k in seen if k.startswith("POST /v1/") and k.endswith(" 200")]
        assert len(generating) == 2, f"no valid request reached generation:\n{summary(seen)}"
        assert seen["POST /tokenize 200"], f"no valid request was tokenized:\n{summary(seen)}"
    finally:
        await service.stop()
        await task


def _short(prompt: Any) -> Any:
    """A generated prompt made short and in the tiny model's vocabulary (2,048 ids): texts
    cut to 40 characters, token ids folded into range, lists cut to 40 items."""
    if isinstance(prompt, str):
        return prompt[:40] or "hi"
    if isinstance(prompt, int) and not isinstance(prompt, bool):
        return abs(prompt) % 2048
    if isinstance(prompt, list):
        return [_short(item) for item in prompt[:40]] or "hi"
    return prompt


async def test_a_prompt_of_no_tokens_is_a_400_and_the_engine_keeps_serving() -> None:
    """Regression: an empty prompt reached the engine loop, whose prefill failed on it; the
    loop died, and every request after it waited forever."""
    service, task = await start_engine(TINY, max_model_len=96)
    base = f"http://127.0.0.1:{service.port}/v1"
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            for prompt in ["", [[]], ["", "1 + 1 ="]]:
                answer = await http.post(
                    f"{base}/completions", json={"model": "tiny-model", "prompt": prompt}
                )
                assert answer.status_code == 400, answer.text
                assert answer.json()["error"]["param"] == "prompt"
            answer = await http.post(
                f"{base}/completions",
                json={"model": "tiny-model", "prompt": "1 + 1 =", "max_tokens": 2},
            )
            assert answer.status_code == 200, answer.text
    finally:
        await service.stop()
        await task
