"""The engine's `POST /tokenize` on the tiny model, against its own generating routes.

The gateway answers Anthropic's `count_tokens` with the chat form, so its ids must be the
`prompt_token_ids` chat completions report for the same request; the chat completions here
go through the real `openai` SDK, `/tokenize` (no SDK method) through httpx.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio

from tests.integration.test_inference_api import CALCULATOR, QUESTION, start_engine
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration

TOOL_TURN = [
    {"role": "developer", "content": "Use the calculator."},
    *QUESTION,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "17 + 25"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "42"},
]
"""A conversation past a tool call, as a harness sends its second request."""


@pytest_asyncio.fixture
async def base_url() -> AsyncIterator[str]:
    service, task = await start_engine(TINY, max_model_len=512)
    try:
        yield f"http://127.0.0.1:{service.port}"
    finally:
        await service.stop()
        await task


async def _tokenize(base_url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{base_url}/tokenize", json=body)


@pytest.mark.parametrize(
    ("messages", "tools", "tool_choice"),
    [
        (QUESTION, None, None),
        (QUESTION, CALCULATOR, None),
        (TOOL_TURN, CALCULATOR, "auto"),
        (QUESTION, CALCULATOR, "none"),  # chat completions leave the tools out then
    ],
)
async def test_the_chat_form_gives_the_prompt_ids_of_the_chat_completion(
    base_url: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: str | None,
) -> None:
    extra = {k: v for k, v in (("tools", tools), ("tool_choice", tool_choice)) if v is not None}
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    completion = await client.chat.completions.create(
        model="tiny-model",
        messages=messages,
        max_tokens=1,
        extra_body={"return_token_ids": True},
        **extra,
    )
    answer = await _tokenize(base_url, {"model": "tiny-model", "messages": messages, **extra})
    assert answer.status_code == 200, answer.text
    tokenized = answer.json()
    assert tokenized["tokens"] == completion.model_dump()["prompt_token_ids"]
    assert tokenized["count"] == len(tokenized["tokens"]) == completion.usage.prompt_tokens
    assert "token_strs" not in tokenized


async def test_the_completion_form_gives_the_prompt_ids_of_the_completion(
    base_url: str,
) -> None:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    completion = await client.completions.create(
        model="tiny-model",
        prompt="The answer is 42.",
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    answer = await _tokenize(base_url, {"prompt": "The answer is 42."})  # no model: the default
    assert answer.status_code == 200, answer.text
    tokenized = answer.json()
    assert tokenized["tokens"] == completion.model_dump()["choices"][0]["prompt_token_ids"]
    assert tokenized["count"] == len(tokenized["tokens"]) == completion.usage.prompt_tokens


async def test_max_model_len_is_the_one_models_lists(base_url: str) -> None:
    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"{base_url}/v1/models")).json()["data"][0]["max_model_len"]
    for body in [{"prompt": "x"}, {"messages": QUESTION}]:
        answer = await _tokenize(base_url, body)
        assert answer.json()["max_model_len"] == listed == 512


async def test_token_strs_are_the_vocabulary_entries_of_the_ids(base_url: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    for body in [{"prompt": "hello world"}, {"messages": QUESTION}]:
        answer = (await _tokenize(base_url, {**body, "return_token_strs": True})).json()
        assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
        assert len(answer["token_strs"]) == answer["count"]


async def test_the_chat_form_can_leave_out_the_generation_prompt_or_continue_a_message(
    base_url: str,
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    served = (await _tokenize(base_url, {"messages": QUESTION})).json()["tokens"]
    bare = (
        await _tokenize(base_url, {"messages": QUESTION, "add_generation_prompt": False})
    ).json()["tokens"]
    assert len(bare) < len(served) and served[: len(bare)] == bare
    assert tokenizer.decode(served[len(bare) :]) == "<|im_start|>assistant\n"
    prefill = [*QUESTION, {"role": "assistant", "content": "The answer"}]
    # add_generation_prompt left at its default gives way to continue_final_message.
    continued = await _tokenize(base_url, {"messages": prefill, "continue_final_message": True})
    assert continued.status_code == 200, continued.text
    assert tokenizer.decode(continued.json()["tokens"]) == (
        tokenizer.decode(bare) + "<|im_start|>assistant\nThe answer"
    )
    with_kwargs = await _tokenize(
        base_url, {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert with_kwargs.json()["tokens"] == served  # a variable this template does not read


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"model": "nope", "messages": QUESTION}, 404, "model", "does not exist"),
        ({"model": "nope", "prompt": "x"}, 404, "model", "does not exist"),
        ({}, 400, None, "`messages` (the chat form) or `prompt` (the completion form)"),
        ({"prompt": "x", "messages": QUESTION}, 400, None, "exactly one of `messages`"),
        ([QUESTION], 400, None, "valid dictionary"),
        ({"prompt": 5}, 400, "prompt", "valid string"),
        ({"prompt": ["x"]}, 400, "prompt", "valid string"),
        ({"prompt": "x", "add_special_tokens": 1}, 400, "add_special_tokens", "valid boolean"),
        ({"messages": "hi"}, 400, "messages", "valid list"),
        ({"messages": []}, 400, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "Input"),
        ({"messages": [{"role": "user"}]}, 400, "messages.0", "needs content"),
        ({"messages": QUESTION, "model": 3}, 400, "model", "valid string"),
        (
            {"messages": QUESTION, "add_generation_prompt": "yes"},
            400,
            "add_generation_prompt",
            "valid boolean",
        ),
        (
            {"messages": QUESTION, "continue_final_message": True, "add_generation_prompt": True},
            400,
            "continue_final_message",
            "cannot be true with add_generation_prompt",
        ),
        (
            {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            400,
            "tools.0.function.name",
            "pattern",
        ),
        (
            {"messages": QUESTION, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
            400,
            "chat_template_kwargs.chat_template",
            "set by the engine",
        ),
        (
            {"messages": QUESTION, "chat_template_kwargs": {"messages": []}},
            400,
            "chat_template_kwargs.messages",
            "set by the engine",
        ),
        (
            {"messages": QUESTION, "chat_template_kwargs": []},
            400,
            "chat_template_kwargs",
            "valid dictionary",
        ),
    ],
)
async def test_bad_tokenize_requests_get_openai_shaped_errors_naming_the_field(
    base_url: str, body: Any, status: int, param: str | None, says: str
) -> None:
    answer = await _tokenize(base_url, body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert says in error["message"]
