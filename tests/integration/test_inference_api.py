"""The inference engine through the real `openai` SDK, on the tiny model, in this process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl.runtime import Runtime
from harnessrl.services.inference.config import InferenceConfig, InferenceSection
from harnessrl.services.inference.service import InferenceService
from tests.model_helpers import TINY, overfit

pytestmark = pytest.mark.integration

CALCULATOR = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 17 + 25?"}]
TOOL_REPLY = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>'
)


async def start_engine(model: Path, **section: Any) -> tuple[InferenceService, asyncio.Task[None]]:
    config = InferenceConfig(
        inference=InferenceSection(model=model, port=0, follow_policy=False, **section)
    )
    runtime = Runtime("inference", "test", CollectorRegistry(), TracerProvider())
    service = InferenceService(config, runtime)
    task = asyncio.create_task(service.run())
    ready = asyncio.ensure_future(service.ready.wait())
    await asyncio.wait([task, ready], timeout=60, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()
    assert service.ready.is_set()
    return service, task


@pytest_asyncio.fixture
async def engine_url() -> AsyncIterator[str]:
    service, task = await start_engine(TINY, max_model_len=512)
    try:
        yield f"http://127.0.0.1:{service.port}/v1"
    finally:
        await service.stop()
        await task


@pytest.fixture
def client(engine_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=engine_url, api_key="unused", max_retries=0)


async def test_a_chat_completion_with_tools_returns_a_tool_call(tmp_path: Path) -> None:
    model = overfit(tmp_path / "tool-model", [(QUESTION, CALCULATOR, TOOL_REPLY)])
    service, task = await start_engine(model)
    try:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{service.port}/v1", api_key="unused", max_retries=0
        )
        response = await client.chat.completions.create(
            model="tool-model", messages=QUESTION, tools=CALCULATOR, temperature=0, max_tokens=40
        )
    finally:
        await service.stop()
        await task
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "17 + 25"}


async def test_streaming_yields_the_same_token_ids_as_non_streaming(
    client: openai.AsyncOpenAI,
) -> None:
    request = {
        "model": "tiny-model",
        "messages": QUESTION,
        "tools": CALCULATOR,
        "seed": 7,
        "max_tokens": 24,
        "extra_body": {"return_token_ids": True},
    }
    whole = (await client.chat.completions.create(**request)).model_dump()
    ids: list[int] = []
    prompt_ids = None
    async for chunk in await client.chat.completions.create(stream=True, **request):
        data = chunk.model_dump()
        prompt_ids = prompt_ids or data.get("prompt_token_ids")
        for choice in data["choices"]:
            ids += choice.get("token_ids") or []
    assert ids == whole["choices"][0]["token_ids"]
    assert prompt_ids == whole["prompt_token_ids"]
    assert len(ids) == 24


async def test_token_ids_decode_to_the_text_with_one_logprob_each(
    client: openai.AsyncOpenAI,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    response = await client.chat.completions.create(
        model="tiny-model",
        messages=QUESTION,
        max_tokens=30,
        logprobs=True,
        top_logprobs=3,
        seed=3,
        extra_body={"return_token_ids": True},
    )
    data = response.model_dump()
    choice = data["choices"][0]
    ids = choice["token_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice["message"]["content"]
    logprobs = choice["logprobs"]["content"]
    assert len(logprobs) == len(ids) == response.usage.completion_tokens
    assert all(entry["logprob"] <= 0 for entry in logprobs)
    assert all(len(entry["top_logprobs"]) == 3 for entry in logprobs)
    rendered = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert data["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]


async def test_completions_accept_token_id_prompts(client: openai.AsyncOpenAI) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    ids = tokenizer("The answer is", add_special_tokens=False)["input_ids"]
    by_ids = await client.completions.create(
        model="tiny-model",
        prompt=ids,
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    by_text = await client.completions.create(
        model="tiny-model",
        prompt="The answer is",
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    a, b = by_ids.model_dump()["choices"][0], by_text.model_dump()["choices"][0]
    assert a["prompt_token_ids"] == ids == b["prompt_token_ids"]
    assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
    assert len(a["logprobs"]["token_logprobs"]) == 8
    assert all(len(top) == 2 for top in a["logprobs"]["top_logprobs"])
    batch = await client.completions.create(
        model="tiny-model",
        prompt=[ids, ids[:2]],
        n=2,
        max_tokens=3,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.model_dump()["choices"][2]["prompt_token_ids"] == ids[:2]


async def test_stop_strings_and_lengths_end_generation(client: openai.AsyncOpenAI) -> None:
    free = await client.completions.create(
        model="tiny-model", prompt="Hello", max_tokens=12, temperature=0
    )
    assert free.choices[0].finish_reason == "length"
    text = free.choices[0].text
    stop = text[3:6]
    stopped = await client.completions.create(
        model="tiny-model", prompt="Hello", max_tokens=12, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


async def test_concurrent_requests_share_decode_steps(engine_url: str) -> None:
    client = openai.AsyncOpenAI(base_url=engine_url, api_key="unused", max_retries=0)
    await asyncio.gather(
        *(
            client.completions.create(model="tiny-model", prompt="Hi", max_tokens=32)
            for _ in range(8)
        )
    )
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(engine_url.removesuffix("/v1") + "/metrics")).text
    sizes = {
        line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("harnessrl_engine_batch_size_bucket")
    }
    assert sizes["4.0"] < sizes["+Inf"]  # some steps decoded more than 4 requests together


async def test_responses_carry_the_policy_version(engine_url: str) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{engine_url}/chat/completions",
            json={"model": "tiny-model", "messages": QUESTION, "max_tokens": 2},
        )
        assert response.headers["x-policy-version"] == "0"
        async with http.stream(
            "POST",
            f"{engine_url}/completions",
            json={"model": "tiny-model", "prompt": "x", "max_tokens": 2, "stream": True},
        ) as stream:
            assert stream.headers["x-policy-version"] == "0"
            assert stream.headers["content-type"].startswith("text/event-stream")
            body = "".join([chunk async for chunk in stream.aiter_text()])
    assert body.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"model": "nope", "messages": QUESTION}, 404, "model", "does not exist"),
        (
            {"model": "tiny-model", "messages": [{"role": "robot", "content": "x"}]},
            400,
            "messages.0.role",
            "Input should be",
        ),
        (
            {"model": "tiny-model", "messages": [{"role": "user"}]},
            400,
            "messages.0",
            "needs content",
        ),
        ({"model": "tiny-model", "messages": []}, 400, "messages", "at least 1"),
        (
            {
                "model": "tiny-model",
                "messages": QUESTION,
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            },
            400,
            "tools.0.function.name",
            "pattern",
        ),
        (
            {
                "model": "tiny-model",
                "messages": QUESTION,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ],
            },
            400,
            "tools.0.function.parameters",
            "type 'object'",
        ),
        (
            {"model": "tiny-model", "messages": [{"role": "user", "content": "x " * 600}]},
            400,
            "messages",
            "maximum context length is 512",
        ),
        (
            {"model": "tiny-model", "messages": QUESTION, "max_tokens": 10_000},
            400,
            "messages",
            "maximum context length",
        ),
        (
            {"model": "tiny-model", "messages": QUESTION, "temperature": 5},
            400,
            "temperature",
            "less than or equal to 2",
        ),
        (
            {"model": "tiny-model", "messages": QUESTION, "frequency_penalty": 1.0},
            400,
            "frequency_penalty",
            "frequency_penalty: penalties are not supported",
        ),
        ({"model": "tiny-model", "prompt": [99_999]}, 400, "prompt", "token ids must be in"),
        # JSON booleans and strings are not coerced to the numbers and flags the schema says.
        ({"model": "tiny-model", "prompt": [True, 5]}, 400, "prompt", "list of token ids"),
        ({"model": "tiny-model", "messages": QUESTION, "n": True}, 400, "n", "valid integer"),
        (
            {"model": "tiny-model", "messages": QUESTION, "stream": "true"},
            400,
            "stream",
            "valid boolean",
        ),
        (
            {"model": "tiny-model", "messages": QUESTION, "temperature": "1"},
            400,
            "temperature",
            "valid number",
        ),
    ],
)
async def test_bad_requests_get_openai_shaped_errors_naming_the_problem(
    engine_url: str, body: dict[str, Any], status: int, param: str | None, says: str
) -> None:
    route = "completions" if "prompt" in body else "chat/completions"
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{engine_url}/{route}", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert says in error["message"]


async def test_malformed_json_is_a_400(engine_url: str) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{engine_url}/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    assert "error" in response.json()


async def test_a_failed_engine_step_is_a_500_or_an_error_event_and_the_engine_serves_on() -> None:
    service, task = await start_engine(TINY, max_model_len=512)
    engine = service.engine
    assert engine is not None

    def fail_next_step() -> None:
        def failing(*_: Any, **__: Any) -> Any:
            del engine.model.forward  # the class's own from the next step on
            raise RuntimeError("out of memory")

        engine.model.forward = failing

    url = f"http://127.0.0.1:{service.port}/v1/chat/completions"
    body = {"model": "tiny-model", "messages": QUESTION, "max_tokens": 4}
    try:
        async with httpx.AsyncClient() as http:
            fail_next_step()
            whole = await http.post(url, json=body)
            assert whole.status_code == 500
            assert whole.json()["error"] == {
                "message": "the engine failed while generating (RuntimeError)",
                "type": "api_error",
                "param": None,
                "code": "engine_error",
            }
            fail_next_step()
            async with http.stream("POST", url, json={**body, "stream": True}) as stream:
                assert stream.status_code == 200
                events = [line async for line in stream.aiter_lines() if line]
            assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_error"
            assert events[-1] == "data: [DONE]"
            after = await http.post(url, json=body)
            assert after.status_code == 200, after.text
    finally:
        await service.stop()
        await task
