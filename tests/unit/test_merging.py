"""Merging one episode's calls into segments: every completion token trained on exactly
once, nothing else trained on, token ids exactly as the engine saw them, breaks classified."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harnessrl.trust.merging import (
    BreakKind,
    Call,
    Dropped,
    MergeResult,
    Segment,
    classify_break,
    merge,
    truncate,
)
from tests.merge_cases import Episode, episodes, injective_decode, make_call

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
PROPERTY = settings(max_examples=150, deadline=None)


def assert_same_result(a: MergeResult, b: MergeResult) -> None:
    assert (a.breaks, a.captured, a.dropped, a.dropped_calls) == (
        b.breaks,
        b.captured,
        b.dropped,
        b.dropped_calls,
    )
    assert len(a.segments) == len(b.segments)
    for x, y in zip(a.segments, b.segments, strict=True):
        assert_same_segment(x, y)


def assert_same_segment(x: Segment, y: Segment) -> None:
    for name in ("token_ids", "loss_mask", "logprobs"):
        ax, ay = getattr(x, name), getattr(y, name)
        assert ax.dtype == ay.dtype and np.array_equal(ax, ay), name
    for name in (
        "call_seqs",
        "policy_version_min",
        "policy_version_max",
        "temperature",
        "span_ids",
        "truncated",
    ):
        assert getattr(x, name) == getattr(y, name), name


@given(episodes())
@PROPERTY
def test_merge_produces_the_segments_the_conversation_built(episode: Episode) -> None:
    result = merge(episode.calls)
    assert list(result.break_kinds) == episode.kinds
    assert len(result.segments) == 1 + len(episode.kinds)
    assert result.duplicates_replaced == episode.replaced
    assert result.temperature_breaks == episode.temperature_breaks
    assert result.seq_conflicts == 0
    assert result.captured == episode.captured
    retried, unused = episode.discarded(choices=False), episode.discarded(choices=True)
    assert result.dropped == {
        Dropped.RETRIED: retried,
        Dropped.UNUSED_CHOICE: unused,
        Dropped.SEQ_CONFLICT: 0,
        Dropped.CONSTRAINED: 0,
    }
    assert result.trained == episode.captured - retried - unused
    for segment, expected in zip(result.segments, episode.segments, strict=True):
        last = expected.calls[-1]
        assert segment.token_ids.dtype == np.uint32
        assert segment.loss_mask.dtype == np.bool_
        assert segment.logprobs.dtype == np.float32
        # Exactly what the engine saw for the segment's last call: nothing re-encoded.
        assert segment.token_ids.tolist() == last.prompt_ids.tolist() + last.completion_ids.tolist()
        assert segment.token_ids.tolist() == expected.ids
        assert segment.loss_mask.tolist() == expected.mask
        assert segment.logprobs.tolist() == expected.logprobs
        assert segment.call_seqs == tuple(c.seq for c in expected.calls)
        assert segment.span_ids == tuple(c.span_id for c in expected.calls)
        assert segment.policy_version_min == min(c.policy_version for c in expected.calls)
        assert segment.policy_version_max == max(c.policy_version for c in expected.calls)
        assert {c.temperature for c in expected.calls} == {segment.temperature}
        assert not segment.truncated


@given(episodes())
@PROPERTY
def test_every_kept_completion_token_is_trained_on_once_in_order(episode: Episode) -> None:
    segments = merge(episode.calls).segments
    trained = np.concatenate([s.token_ids[s.loss_mask] for s in segments])
    behaviour = np.concatenate([s.logprobs[s.loss_mask] for s in segments])
    kept = episode.kept
    assert trained.tolist() == [t for c in kept for t in c.completion_ids.tolist()]
    assert behaviour.tolist() == [x for c in kept for x in c.logprobs.tolist()]
    assert all(not s.logprobs[~s.loss_mask].any() for s in segments)
    assert [seq for s in segments for seq in s.call_seqs] == [c.seq for c in kept]


@given(episodes(), st.data())
@PROPERTY
def test_merge_ignores_call_order_and_redelivery(episode: Episode, data: st.DataObject) -> None:
    redelivered = data.draw(st.lists(st.sampled_from(episode.calls), max_size=6))
    shuffled = data.draw(st.permutations(episode.calls + redelivered))
    assert_same_result(merge(shuffled), merge(episode.calls))
    assert_same_result(merge(shuffled), merge(shuffled))


@given(episodes())
@PROPERTY
def test_an_injective_decode_never_reports_retokenization(episode: Episode) -> None:
    """Distinct ids always decode to distinct text here, so decoding changes no verdict
    (only the breaks' surroundings are given as text)."""
    decoded, plain = merge(episode.calls, decode=injective_decode), merge(episode.calls)
    assert [dataclasses.replace(b, recorded="", sent="") for b in decoded.breaks] == list(
        plain.breaks
    )
    assert_same_result(dataclasses.replace(decoded, breaks=plain.breaks), plain)


def test_merge_masks_tool_output_and_headers_between_turns() -> None:
    first = make_call(0, [1, 2], [3, 4])
    second = make_call(1, [1, 2, 3, 4, 9, 9, 5], [6])
    [segment] = merge([first, second]).segments
    assert segment.token_ids.tolist() == [1, 2, 3, 4, 9, 9, 5, 6]
    assert segment.loss_mask.tolist() == [False, False, True, True, False, False, False, True]
    assert segment.logprobs[segment.loss_mask].tolist() == (
        first.logprobs.tolist() + second.logprobs.tolist()
    )
    assert segment.call_seqs == (0, 1)


# A tiny vocabulary where [1] and [2, 3] are the same text.
WORDS = {1: "ab", 2: "a", 3: "b", 4: "c", 5: "<t>", 6: "<think>", 7: "</think>", 8: "x"}


def words(ids: Sequence[int]) -> str:
    return "".join(WORDS[i] for i in ids)


def test_same_text_in_other_ids_is_a_retokenization_break() -> None:
    calls = [make_call(0, [4], [2, 3]), make_call(1, [4, 1, 5], [8])]
    result = merge(calls, decode=words)
    assert result.break_kinds == (BreakKind.RETOKENIZATION,)
    assert result.break_counts[BreakKind.RETOKENIZATION] == 1
    [b] = result.breaks
    assert (b.seq, b.nearest_seq, b.position, b.recorded, b.sent) == (1, 0, 1, "cab", "cab<t>")
    assert [s.token_ids.tolist() for s in result.segments] == [[4, 2, 3], [4, 1, 5, 8]]
    # Without a decoder it cannot be told apart: the first difference is in the completion.
    assert merge(calls).break_kinds == (BreakKind.CHAT_TEMPLATE,)


def test_stripped_reasoning_in_an_earlier_turn_is_a_chat_template_break() -> None:
    calls = [
        make_call(0, [4, 5], [6, 8, 8, 7, 2]),  # <think>xx</think>a
        make_call(1, [4, 5, 6, 8, 8, 7, 2, 5, 4], [6, 8, 7, 3]),
        make_call(2, [4, 5, 2, 5, 4, 5, 3, 5], [8]),  # both <think> blocks dropped
    ]
    result = merge(calls, decode=words)
    assert result.break_kinds == (BreakKind.CHAT_TEMPLATE,)
    assert result.break_counts == {kind: kind == BreakKind.CHAT_TEMPLATE for kind in BreakKind}
    assert [s.call_seqs for s in result.segments] == [(0, 1), (2,)]


def test_a_compaction_from_the_first_assistant_turn_is_a_compaction() -> None:
    calls = [
        make_call(0, [4], [2, 2]),
        make_call(1, [4, 2, 2, 5, 8, 8, 8, 5], [3]),  # tool result "xxx"
        make_call(2, [4, 2, 5, 5, 3, 5], [1]),  # the turns from the first reply summarised
        make_call(3, [4, 2, 5, 5, 3, 5, 1, 5], [2]),  # and the conversation goes on
    ]
    result = merge(calls, decode=words)
    assert result.break_kinds == (BreakKind.COMPACTION,)
    assert [s.call_seqs for s in result.segments] == [(0, 1), (2, 3)]
    assert result.segments[1].loss_mask.tolist() == [False] * 6 + [True, False, True]
    # One that nothing extends cannot be told from a side call with the same beginning.
    assert merge(calls[:3], decode=words).break_kinds == (BreakKind.SIDE_CHAIN,)


def test_a_system_prompt_line_that_changes_per_call_is_an_edit_not_a_compaction() -> None:
    """A request id in the system prompt (as Claude Code sends): the few ids of the changed
    line differ, the rest of that long run of inserted text (the system prompt after it,
    the first user turn) reappears: every call is an `other` break, not a side call."""
    head, rest = list(range(10, 30)), list(range(40, 80))  # system prompt around the id

    def system(request_id: int) -> list[int]:
        return [*head, request_id, request_id + 1, request_id + 2, *rest]

    user, answer, again = list(range(100, 120)), [7, 8, 9], list(range(120, 130))
    calls = [
        make_call(0, [*system(200), *user], answer),
        make_call(1, [*system(300), *user, *answer, *again], [6]),
        make_call(2, [*system(400), *user, *answer, *again, 6, 5], [4]),
    ]
    result = merge(calls)
    assert result.break_kinds == (BreakKind.OTHER, BreakKind.OTHER)
    assert [b.position for b in result.breaks] == [len(head), len(head)]


def test_a_branch_keeps_the_longer_line_in_its_chain() -> None:
    """A call that extends an earlier call's whole context, not its chain's last one, is a
    branch there (a rewind, or a side call on the conversation so far): the longer line
    keeps the chain, the other is a side chain; the sequences are the same either way."""
    calls = [
        make_call(0, [4], [2]),
        make_call(1, [4, 2, 5, 8, 8, 8, 5], [3]),  # this line ends here
        make_call(2, [4, 2, 5, 5], [1]),  # branches from call 0
        make_call(3, [4, 2, 5, 5, 1, 5], [2]),
    ]
    result = merge(calls)
    assert [s.call_seqs for s in result.segments] == [(0, 2, 3), (1,)]
    assert result.break_kinds == (BreakKind.SIDE_CHAIN,)
    assert [s.token_ids.tolist() for s in result.segments] == [
        [4, 2, 5, 5, 1, 5, 2],
        [4, 2, 5, 8, 8, 8, 5, 3],
    ]
    assert result.segments[1].loss_mask.tolist() == [False] * 7 + [True]


def test_a_difference_right_after_a_completion_counts_as_chat_template() -> None:
    context = np.array([4, 2, 3, 5, 8], dtype=np.uint32)
    prompt = np.array([4, 2, 3, 7, 8], dtype=np.uint32)
    assert classify_break(context, prompt, [(1, 3), (4, 5)]) == BreakKind.CHAT_TEMPLATE
    # Inserted text after the difference that is gone is a compaction, wherever it starts.
    assert classify_break(context, prompt[:1], [(1, 3), (4, 5)]) == BreakKind.COMPACTION
    assert classify_break(context, np.array([9], dtype=np.uint32), [(1, 3)]) == (
        BreakKind.COMPACTION
    )
    # An inserted id changed in place, the rest kept: a rewrite.
    rewritten = np.array([7, 2, 3, 5, 8], dtype=np.uint32)
    assert classify_break(context, rewritten, [(1, 3)]) == BreakKind.OTHER


def test_a_temperature_change_starts_a_segment_counted_as_other() -> None:
    calls = [
        make_call(0, [1], [2], temperature=1.0),
        make_call(1, [1, 2, 3], [4], temperature=0.6),
        make_call(2, [1, 2, 3, 4, 5], [6], temperature=0.6),
    ]
    result = merge(calls)
    assert result.break_kinds == (BreakKind.OTHER,)
    assert result.temperature_breaks == 1
    assert [(s.call_seqs, s.temperature) for s in result.segments] == [((0,), 1.0), ((1, 2), 0.6)]
    assert result.segments[1].loss_mask.tolist() == [False, False, False, True, False, True]


def test_a_retried_call_keeps_only_the_last_attempt() -> None:
    calls = [
        make_call(0, [1], [2]),
        make_call(1, [1, 2, 3], [7, 7]),
        make_call(2, [1, 2, 3], [8]),  # retry: the harness discarded seq 1's answer
        make_call(3, [1, 2, 3, 8, 4], [5]),
    ]
    result = merge(calls)
    assert result.duplicates_replaced == 1
    [segment] = result.segments
    assert segment.call_seqs == (0, 2, 3)
    assert segment.token_ids[segment.loss_mask].tolist() == [2, 8, 5]


def test_choices_of_one_request_keep_the_last() -> None:
    calls = [make_call(seq, [1, 2], [seq + 3]) for seq in range(3)]
    result = merge(calls)
    assert result.duplicates_replaced == 2
    assert [s.call_seqs for s in result.segments] == [(2,)]


def test_a_seq_delivered_with_different_contents_keeps_one_copy_whatever_the_order() -> None:
    a = make_call(0, [1], [2])
    b = make_call(0, [1], [3])
    later = make_call(1, [1, 2, 4], [5])
    for calls in ([a, b, later], [later, b, a], [b, later, a, b]):
        result = merge(calls)
        assert result.seq_conflicts == 1
        assert [s.token_ids.tolist() for s in result.segments] == [[1, 2, 4, 5]]
    assert merge([a, a, later]).seq_conflicts == 0


def test_a_call_with_empty_completion_trains_on_nothing_of_its_own() -> None:
    calls = [make_call(0, [1], []), make_call(1, [1, 2], [3])]
    [segment] = merge(calls).segments
    assert segment.loss_mask.tolist() == [False, False, True]


def test_no_calls_give_no_segments() -> None:
    result = merge([])
    assert result.segments == [] and result.break_kinds == ()


def test_logprobs_not_matching_the_completion_name_the_call() -> None:
    good = make_call(0, [1], [2])
    bad = Call(
        seq=7,
        prompt_ids=np.array([1, 2, 3], dtype=np.uint32),
        completion_ids=np.array([4, 5], dtype=np.uint32),
        logprobs=np.array([-0.5], dtype=np.float32),
        policy_version=0,
        temperature=1.0,
        span_id="s",
    )
    with pytest.raises(ValueError, match="call seq 7: 1 logprobs for 2 completion tokens"):
        merge([good, bad])


def test_truncate_keeps_the_prefix_and_marks_it() -> None:
    [segment] = merge([make_call(0, [1, 2], [3, 4]), make_call(1, [1, 2, 3, 4, 5], [6])]).segments
    cut = truncate(segment, 3)
    assert cut.truncated and not segment.truncated
    assert cut.token_ids.tolist() == [1, 2, 3]
    assert cut.loss_mask.tolist() == [False, False, True]
    assert cut.logprobs.tolist() == segment.logprobs[:3].tolist()
    assert cut.call_seqs == segment.call_seqs
    assert truncate(segment, 6) is segment
    with pytest.raises(ValueError, match="max_tokens"):
        truncate(segment, 0)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY, local_files_only=True)


def test_real_tokenizer_breaks_are_classified(tokenizer: PreTrainedTokenizerBase) -> None:
    """The tiny model's tokenizer and chat template: a reply the engine sampled as other ids
    than the template's re-encoding is a retokenization; a tool call whose arguments the
    template re-serializes is a chat-template difference."""

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt(messages: list[dict[str, Any]]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str)
        return encode(text)

    end = encode("<|im_end|>")
    user: dict[str, Any] = {"role": "user", "content": "hi"}
    sampled = encode("h") + encode("ello") + end
    assert encode("hello") != encode("h") + encode("ello")
    retokenized = [
        make_call(0, prompt([user]), sampled),
        make_call(1, prompt([user, {"role": "assistant", "content": "hello"}, user]), [5]),
    ]
    assert merge(retokenized, decode=decode).break_kinds == (BreakKind.RETOKENIZATION,)

    raw = '<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call>'
    call = {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
    rendered: list[dict[str, Any]] = [
        user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "2"},
    ]
    re_rendered = [
        make_call(0, prompt([user]), encode(raw) + end),
        make_call(1, prompt(rendered), [5]),
    ]
    assert decode(re_rendered[1].prompt_ids.tolist()).count('{"a": 1}') == 1
    assert merge(re_rendered, decode=decode).break_kinds == (BreakKind.CHAT_TEMPLATE,)


def test_ids_of_another_dtype_are_refused_naming_the_call() -> None:
    call = make_call(3, [1, 2], [3])
    wide = Call(
        seq=3,
        prompt_ids=call.prompt_ids.astype(np.int64),
        completion_ids=call.completion_ids,
        logprobs=call.logprobs,
        policy_version=0,
        temperature=1.0,
        span_id="s",
    )
    with pytest.raises(ValueError, match="call seq 3: prompt_ids must be a 1-D uint32 array"):
        merge([wide])
