"""Chains: what real harnesses do besides one linear tool loop, with the right answers
written down. Side calls and sub-agents become chains of their own without breaking the main
one; of several calls with the same prompt the one the harness went on with is trained;
every captured completion token is trained once or dropped with its reason."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from harnessrl.trust.merging import BreakKind, Call, Dropped, Segment, merge
from tests.merge_cases import make_call

SYSTEM = list(range(100, 110))
SIDE_SYSTEM = list(range(200, 206))


def _ids(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def _main_loop(turns: int) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt, completion) of each main call: a 10-id system prompt, a task, then per turn
    a 5-id reply and an 8-id tool result."""
    context = [*SYSTEM, 1, 2, 3]
    prompts, completions = [], []
    for k in range(turns):
        reply = _ids(5, 1000 + 10 * k)
        prompts.append(list(context))
        completions.append(reply)
        context += reply + _ids(8, 5000 + 10 * k)
    return prompts, completions


def _trained_once(calls: list[Call], segments: list[Segment]) -> None:
    """Every call is in exactly one chain, its completion trained there, in place."""
    seqs = [seq for s in segments for seq in s.call_seqs]
    assert sorted(seqs) == [c.seq for c in calls]
    by_seq = {c.seq: c for c in calls}
    for segment in segments:
        trained = segment.token_ids[segment.loss_mask].tolist()
        assert trained == [t for q in segment.call_seqs for t in by_seq[q].completion_ids.tolist()]


@pytest.mark.parametrize("turns", [20, 300])
def test_an_independent_side_call_after_each_main_call_is_a_chain_of_its_own(turns: int) -> None:
    """20 main calls, each followed by a summariser call with its own system prompt: one
    sequence for the main loop plus one per side call (21, not 41), no more tokens than
    those sequences need. The same at 300 (more chains than a break is compared with)."""
    prompts, completions = _main_loop(turns)
    calls: list[Call] = []
    sides: list[list[int]] = []
    for k in range(turns):
        calls.append(make_call(len(calls), prompts[k], completions[k]))
        side = [*SIDE_SYSTEM, *_ids(10, 100_000 + 10 * k)]
        sides.append(side)
        calls.append(make_call(len(calls), side, _ids(4, 200_000 + 10 * k)))
    result = merge(calls)
    assert len(result.segments) == turns + 1
    main = result.segments[0]
    assert main.call_seqs == tuple(range(0, 2 * turns, 2))
    assert [s.call_seqs for s in result.segments[1:]] == [(k,) for k in range(1, 2 * turns, 2)]
    # The side calls are side chains; the last has nothing after it to tell it from a
    # compaction, and nothing extends it, so it is a side call too.
    assert result.break_kinds == (BreakKind.SIDE_CHAIN,) * turns
    # Each is compared with the context sharing its longest prefix: the side call before it
    # (the same system prompt), the first with the main loop.
    assert [b.nearest_seq for b in result.breaks] == [0, *range(1, 2 * turns - 2, 2)]
    minimum = len(prompts[-1]) + 5 + sum(len(side) + 4 for side in sides)
    total = sum(len(s.token_ids) for s in result.segments)
    assert total <= 1.1 * minimum
    assert total == minimum
    _trained_once(calls, result.segments)
    assert result.captured == result.trained == turns * 5 + turns * 4


def test_a_side_call_on_the_whole_conversation_branches_from_it() -> None:
    """A summariser sent the main conversation so far plus an instruction extends the main
    call before it; the main loop goes on from that call, not from the summary."""
    prompts, completions = _main_loop(20)
    calls: list[Call] = []
    for k in range(20):
        calls.append(make_call(len(calls), prompts[k], completions[k]))
        side = [*prompts[k], *completions[k], 77, 78, 79]  # "summarise the above"
        calls.append(make_call(len(calls), side, _ids(4, 9000 + 10 * k)))
    result = merge(calls)
    # The last summary extends the last main call and nothing goes on from either: it
    # ends the main chain, so 20 sequences (the least possible), 19 side chains.
    assert len(result.segments) == 20
    assert result.segments[0].call_seqs == (*range(0, 40, 2), 39)
    assert result.break_kinds == (BreakKind.SIDE_CHAIN,) * 19
    minimum = (
        sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls[1:-1:2])
        + len(calls[-1].prompt_ids)
        + 4
    )
    assert sum(len(s.token_ids) for s in result.segments) == minimum
    # Each side sequence carries the main context it was sent (mask 0) and its summary.
    side = result.segments[5]
    assert side.call_seqs == (9,)
    assert side.loss_mask.tolist() == [False] * (len(side.token_ids) - 4) + [True] * 4
    _trained_once(calls, result.segments)


def test_a_sub_agent_interleaved_with_the_main_loop_keeps_both_chains_whole() -> None:
    """A sub-agent (own system prompt, its own tool loop of 4 calls) runs while the main
    loop goes on: two chains, whatever the interleaving."""
    prompts, completions = _main_loop(6)
    sub_context = [*SIDE_SYSTEM, 9, 9]
    sub: list[tuple[list[int], list[int]]] = []
    for k in range(4):
        reply = _ids(3, 3000 + 10 * k)
        sub.append((list(sub_context), reply))
        sub_context += [*reply, 60 + k, 61 + k]
    order = ["m", "m", "s", "m", "s", "s", "m", "s", "m", "m"]
    calls: list[Call] = []
    main_iter, sub_iter = iter(zip(prompts, completions, strict=True)), iter(sub)
    for who in order:
        prompt, completion = next(main_iter if who == "m" else sub_iter)
        calls.append(make_call(len(calls), prompt, completion))
    result = merge(calls)
    seqs = [s.call_seqs for s in result.segments]
    assert seqs == [(0, 1, 3, 6, 8, 9), (2, 4, 5, 7)]
    assert result.break_kinds == (BreakKind.SIDE_CHAIN,)
    assert result.segments[1].token_ids.tolist() == sub[-1][0] + sub[-1][1]
    _trained_once(calls, result.segments)


def test_n_choices_train_the_one_the_harness_went_on_with() -> None:
    """`n: 2` gives two ModelCalls with one span; the harness continues with choice 0:
    choice 0 is trained, choice 1 dropped as unused_choice, no break."""
    for used in (0, 1):
        first = make_call(0, [1, 2], [10, 11])
        second = make_call(1, [1, 2], [20, 21, 22])
        choices = [first, _with_span(second, first.span_id)]
        picked = choices[used]
        later = make_call(2, [1, 2, *picked.completion_ids.tolist(), 5], [30])
        result = merge([*choices, later])
        [segment] = result.segments
        assert segment.call_seqs == (used, 2)
        assert result.breaks == ()
        assert result.dropped[Dropped.UNUSED_CHOICE] == len(choices[1 - used].completion_ids)
        assert result.dropped_calls == {
            Dropped.RETRIED: 0,
            Dropped.UNUSED_CHOICE: 1,
            Dropped.SEQ_CONFLICT: 0,
            Dropped.CONSTRAINED: 0,
        }
        assert (
            result.captured == 2 + 3 + 1 == result.trained + result.dropped[Dropped.UNUSED_CHOICE]
        )


def test_a_late_retry_whose_first_copy_was_used_is_the_one_dropped() -> None:
    """The harness got its answer to seq 1, but the gateway also saw a retry of it (the
    client timed out and sent it again) and the harness went on with the first."""
    calls = [
        make_call(0, [1], [2]),
        make_call(1, [1, 2, 3], [7, 7]),
        make_call(2, [1, 2, 3], [8]),  # a retry whose answer the harness never read
        make_call(3, [1, 2, 3, 7, 7, 4], [5]),
    ]
    result = merge(calls)
    [segment] = result.segments
    assert segment.call_seqs == (0, 1, 3)
    assert result.dropped[Dropped.RETRIED] == 1
    assert result.breaks == ()


def test_choices_nobody_went_on_with_keep_the_last() -> None:
    calls = [_with_span(make_call(seq, [1, 2], [seq + 3]), "span-n") for seq in range(3)]
    result = merge(calls)
    assert [s.call_seqs for s in result.segments] == [(2,)]
    assert result.dropped_calls[Dropped.UNUSED_CHOICE] == 2


def test_every_copy_of_a_seq_is_in_the_books() -> None:
    a = make_call(0, [1], [2])
    b = make_call(0, [1], [3, 3])
    later = make_call(1, [1, 2, 4], [5])
    for calls in itertools.permutations([a, b, later, a]):
        result = merge(list(calls))
        assert result.captured == 1 + 2 + 1
        assert result.dropped[Dropped.SEQ_CONFLICT] == 2
        assert result.trained == 2
        assert result.seq_conflicts == 1


def test_a_constrained_call_is_context_not_trained() -> None:
    """A train call sampled under constrained decoding (a JSON schema, a forced tool) keeps
    its place in the chain, its completion mask 0 and counted as dropped `constrained`."""
    calls = [
        make_call(0, [1], [2, 2]),
        dataclasses.replace(make_call(1, [1, 2, 2, 3], [4, 4, 4]), constrained=True),
        make_call(2, [1, 2, 2, 3, 4, 4, 4, 5], [6]),
    ]
    result = merge(calls)
    [segment] = result.segments
    assert segment.call_seqs == (0, 1, 2)
    assert segment.loss_mask.tolist() == [
        False,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
        True,
    ]
    assert not segment.logprobs[4:7].any()
    assert result.dropped[Dropped.CONSTRAINED] == 3
    assert result.captured == 6 == result.trained + 3


def _with_span(call: Call, span_id: str) -> Call:
    return Call(
        seq=call.seq,
        prompt_ids=call.prompt_ids,
        completion_ids=call.completion_ids,
        logprobs=call.logprobs,
        policy_version=call.policy_version,
        temperature=call.temperature,
        span_id=span_id,
    )
