"""One episode's model calls become training sequences (chains), every completion token
accounted for.

Training uses the token ids the engine saw and produced; text is never re-encoded. Real
harnesses do more than one linear conversation: a summariser or a sub-agent between two
main-loop calls, n > 1 choices, retries, compaction, templates that re-render history. So
the calls are arranged as a tree first, then cut into chains:

1. **Parent.** A call's parent is the earlier call (lower seq) whose context (prompt +
   completion) is the longest prefix of the call's prompt; a call that extends no recorded
   context is a root. Nothing but the token ids decides: another conversation's call in
   between never breaks a chain.
2. **Retries and choices.** Calls with identical prompt ids are alternatives (the choices
   of one n > 1 request share its span; a retry has its own). Every alternative a later
   call extends is kept; when none is extended the last is kept; the others are dropped,
   `unused_choice` (a choice of a request whose other choice was kept) or `retried`.
3. **Chains.** Each kept call continues its parent's chain unless it was sampled at
   another temperature (a sequence is trained at one temperature), or a sibling does: of a
   call's children the one with the longest line of descendants continues (on a tie, the
   earliest: an older line keeps its chain), the others start chains of their own. A
   chain's sequence is its last call's prompt + completion: its own calls' completions
   have loss mask 1 with their behaviour log-probs, everything else (tool results, inserted
   turns, other chains' completions it carries as context, and the completion of a call
   sampled under constrained decoding) mask 0. Each completion token is in at most one
   chain's mask.
4. **Breaks.** Every chain after the first is a break, classified against the chain begun
   before it whose context, as it stood then, shares the longest prefix with its prompt:
   `side_chain` when an older chain goes on after it (a sub-agent, a summariser, a side
   call) or it branched off a context unchanged; else `retokenization` (the same text in
   other ids, when a decoder is given), `compaction` (most of the context's inserted text
   after the first difference is gone: history dropped or summarised), `chat_template`
   (the first difference lies in or right after a completion and the context's later
   inserted text reappears: the template re-rendered an assistant turn, such as Qwen3
   dropping `<think>`), else `other` (an earlier prompt or tool result rewritten in place,
   a temperature change). A compacted conversation goes on: a call that looks like one but
   that no later call extends is a side call (a last helper call with the system prompt of
   the one before); a side conversation of several calls that comes last has nothing after
   it to tell it from a compaction, and counts as its content says.
5. **Books.** `captured` is the completion tokens of the distinct calls given; every one is
   trained (in a chain's mask) or counted in `dropped` by reason, so
   `captured == trained + sum(dropped.values())` always.

Everything is pure and works on whole arrays: a prefix test is a byte comparison of the ids
(memcmp) after a cheap check of the last ids (one by one for the longest few contexts, in
one vector operation over the rest), a chain is one concatenation plus a slice per call, a
break is compared with at most 34 earlier chains, and `decode` runs only at breaks: the
Python work is linear in the episode's calls however many chains it has. Steps 1-3 are in
tree.py, step 4 in breaks.py; this module is the entry point and the sequences.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from harnessrl.trust.breaks import Break, BreakKind, classify_break, find_breaks
from harnessrl.trust.calls import Call, Decode, Ids, Logprobs, Mask
from harnessrl.trust.tree import (
    Dropped,
    build_tree,
    cut_chains,
    drop_alternatives,
    ids_of,
)

__all__ = [
    "Break",
    "BreakKind",
    "Call",
    "Decode",
    "Dropped",
    "MergeResult",
    "Segment",
    "classify_break",
    "merge",
    "truncate",
]

_U32 = np.dtype(np.uint32)


@dataclass(frozen=True, slots=True)
class Segment:
    """One training sequence (a chain): its last call's prompt + completion, with masks.

    Arrays: token_ids uint32 [T], loss_mask bool [T], logprobs float32 [T] (0 where the
    mask is False). Completion tokens of every call of the chain have mask True.
    """

    token_ids: Ids
    loss_mask: Mask
    logprobs: Logprobs
    call_seqs: tuple[int, ...]
    """Seqs of the chain's calls, ascending."""
    policy_version_min: int
    policy_version_max: int
    temperature: float
    """The one temperature all of the chain's calls were sampled at."""
    span_ids: tuple[str, ...]
    """Span ids of the chain's calls, in call_seqs order."""
    truncated: bool = False
    """True when `truncate` cut the segment; the calls are still all listed."""
    source: object = None
    """The `source` of its last call, whose prompt + completion `token_ids` is."""

    @property
    def trained_tokens(self) -> int:
        return int(np.count_nonzero(self.loss_mask))


@dataclass(frozen=True, slots=True)
class MergeResult:
    """The chains of one episode and how they came about."""

    segments: list[Segment]
    """One per chain, in the order of their first calls."""
    breaks: tuple[Break, ...]
    """Why each chain after the first started: breaks[i] started segments[i + 1]."""
    captured: int
    """Completion tokens of the distinct calls given (copies of a seq with other contents
    each count)."""
    dropped: dict[Dropped, int]
    """Completion tokens not trained, by reason; every reason is present."""
    dropped_calls: dict[Dropped, int]
    """Calls not trained, by reason; every reason is present."""

    @property
    def break_kinds(self) -> tuple[BreakKind, ...]:
        return tuple(b.kind for b in self.breaks)

    @property
    def break_counts(self) -> dict[BreakKind, int]:
        """Number of breaks of each kind; every kind is present."""
        counts = Counter(self.break_kinds)
        return {kind: counts[kind] for kind in BreakKind}

    @property
    def temperature_breaks(self) -> int:
        """Chains started because the call was sampled at another temperature than the
        chain it extends (their breaks are OTHER)."""
        return sum(b.temperature_change for b in self.breaks)

    @property
    def trained(self) -> int:
        return sum(s.trained_tokens for s in self.segments)

    @property
    def duplicates_replaced(self) -> int:
        """Alternatives dropped (retries and unused choices)."""
        return self.dropped_calls[Dropped.RETRIED] + self.dropped_calls[Dropped.UNUSED_CHOICE]

    @property
    def seq_conflicts(self) -> int:
        return self.dropped_calls[Dropped.SEQ_CONFLICT]


def merge(calls: Sequence[Call], *, decode: Decode | None = None) -> MergeResult:
    """Merge one episode attempt's calls into chains (see the module docstring).

    Calls may come in any order and repeated (redelivered events); the result depends only
    on the set of calls. The same seq twice with the same contents is one call; copies
    with other contents are kept one (the one whose contents sort first: prompt ids,
    completion ids, log-probs as bytes, then policy version, temperature, span id), the
    others dropped as `seq_conflict`. `decode` lets breaks be classified as RETOKENIZATION
    and their surroundings be reported as text.

    Raises ValueError, naming the call's seq, when its ids are not 1-D uint32 arrays or
    its log-probs do not match its completion in shape.
    """
    for call in calls:
        _check(call)
    dropped: Counter[Dropped] = Counter()
    dropped_calls: Counter[Dropped] = Counter()
    unique, captured = _one_per_seq(calls, dropped, dropped_calls)
    nodes = build_tree(unique)
    nodes = drop_alternatives(nodes, dropped, dropped_calls)
    chains = cut_chains(nodes)
    segments = [_segment([nodes[i].call for i in chain]) for chain in chains]
    for node in nodes:
        if node.call.constrained:
            dropped[Dropped.CONSTRAINED] += len(node.call.completion_ids)
            dropped_calls[Dropped.CONSTRAINED] += 1
    breaks = tuple(find_breaks(nodes, chains, decode))
    return MergeResult(
        segments=segments,
        breaks=breaks,
        captured=captured,
        dropped={reason: dropped[reason] for reason in Dropped},
        dropped_calls={reason: dropped_calls[reason] for reason in Dropped},
    )


def truncate(segment: Segment, max_tokens: int) -> Segment:
    """The first `max_tokens` tokens of `segment`, marked truncated; unchanged if it fits.

    The arrays are views of the original ones. call_seqs, span_ids and the policy versions
    still name every call of the segment, including any whose completion was cut off.
    Raises ValueError when max_tokens < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
    if len(segment.token_ids) <= max_tokens:
        return segment
    return dataclasses.replace(
        segment,
        token_ids=segment.token_ids[:max_tokens],
        loss_mask=segment.loss_mask[:max_tokens],
        logprobs=segment.logprobs[:max_tokens],
        truncated=True,
    )


# -- one call per seq ------------------------------------------------------------------------


def _check(call: Call) -> None:
    # Ids are compared as bytes, so they must all have the same dtype.
    for name, ids in (("prompt_ids", call.prompt_ids), ("completion_ids", call.completion_ids)):
        if ids.dtype != _U32 or ids.ndim != 1:
            raise ValueError(
                f"call seq {call.seq}: {name} must be a 1-D uint32 array, "
                f"not {ids.ndim}-D {ids.dtype}"
            )
    if call.logprobs.shape != call.completion_ids.shape:
        raise ValueError(
            f"call seq {call.seq}: {call.logprobs.size} logprobs for "
            f"{call.completion_ids.size} completion tokens"
        )


def _one_per_seq(
    calls: Sequence[Call], dropped: Counter[Dropped], dropped_calls: Counter[Dropped]
) -> tuple[list[Call], int]:
    """One call per seq, ascending; and the completion tokens of the distinct copies."""
    by_seq: dict[int, list[Call]] = {}
    for call in calls:
        by_seq.setdefault(call.seq, []).append(call)
    unique: list[Call] = []
    captured = 0
    for seq in sorted(by_seq):
        copies = by_seq[seq]
        if len(copies) == 1:  # the common case: contents need not be compared
            unique.append(copies[0])
            captured += len(copies[0].completion_ids)
            continue
        distinct: dict[tuple[bytes, bytes, bytes, int, float, str], Call] = {}
        for call in copies:
            distinct.setdefault(_content(call), call)
        keep = min(distinct)
        unique.append(distinct[keep])
        for content, call in distinct.items():
            captured += len(call.completion_ids)
            if content != keep:
                dropped[Dropped.SEQ_CONFLICT] += len(call.completion_ids)
                dropped_calls[Dropped.SEQ_CONFLICT] += 1
    return unique, captured


def _content(call: Call) -> tuple[bytes, bytes, bytes, int, float, str]:
    return (
        call.prompt_ids.tobytes(),
        call.completion_ids.tobytes(),
        call.logprobs.tobytes(),
        call.policy_version,
        call.temperature,
        call.span_id,
    )


# -- sequences --------------------------------------------------------------------------------


def _segment(chain: list[Call]) -> Segment:
    """The sequence of `chain`: its last call's prompt + completion, with masks."""
    token_ids = ids_of(chain[-1])
    loss_mask = np.zeros(len(token_ids), dtype=np.bool_)
    logprobs = np.zeros(len(token_ids), dtype=np.float32)
    for call in chain:
        if call.constrained:
            continue  # context only: mask 0
        start = len(call.prompt_ids)
        end = start + len(call.completion_ids)
        loss_mask[start:end].fill(True)
        logprobs[start:end] = call.logprobs
    versions = [c.policy_version for c in chain]
    return Segment(
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        call_seqs=tuple(c.seq for c in chain),
        policy_version_min=min(versions),
        policy_version_max=max(versions),
        temperature=chain[0].temperature,
        span_ids=tuple(c.span_id for c in chain),
        source=chain[-1].source,
    )
