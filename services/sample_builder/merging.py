"""One episode's model calls become training segments, every completion token accounted for.

Training uses the token ids the engine saw and produced; text is never re-encoded. Calls are
walked in seq order. A call whose prompt ids start with the segment so far (the previous
call's prompt + completion) extends the segment: the ids in between (tool results, new user
turns, the next assistant header) get loss mask 0, its completion mask 1 with its behaviour
log-probs. Any other call, or one sampled at another temperature, closes the segment and
starts a new one whose whole prompt has mask 0; the break is classified and counted.

Everything here is pure and works on whole arrays: a prefix test is a byte comparison of
the ids (memcmp), a segment is one concatenation plus a slice per call, and `decode` runs
only at breaks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from operator import attrgetter

import numpy as np
import numpy.typing as npt

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens included (used to classify breaks, never to train)."""

Ids = npt.NDArray[np.uint32]
Mask = npt.NDArray[np.bool_]
Logprobs = npt.NDArray[np.float32]

_U32 = np.dtype(np.uint32)


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded model call of an episode (the fields of ModelCall that merging uses)."""

    seq: int
    """Position of the call within the episode attempt, assigned by the gateway."""
    prompt_ids: Ids
    """Prompt token ids exactly as the engine saw them, 1-D uint32."""
    completion_ids: Ids
    """Completion token ids exactly as the engine sampled them, 1-D uint32."""
    logprobs: Logprobs
    """Behaviour log-prob of each completion token; same length as completion_ids."""
    policy_version: int
    temperature: float
    span_id: str
    """Hex span id of the gateway's span for the call (trace link)."""


class BreakKind(StrEnum):
    """Why a call did not extend the segment before it (MergeStats' three break counters)."""

    CHAT_TEMPLATE = "chat_template"
    """An earlier assistant turn was re-rendered differently by the chat template."""
    RETOKENIZATION = "retokenization"
    """The same text came back as different token ids."""
    OTHER = "other"
    """Context rewritten, compacted or truncated, a new conversation, a temperature change."""


@dataclass(frozen=True, slots=True)
class Segment:
    """One training sequence: the last call's prompt + completion, with masks.

    Arrays: token_ids uint32 [T], loss_mask bool [T], logprobs float32 [T] (0 where the
    mask is False). Completion tokens of every call of the segment have mask True.
    """

    token_ids: Ids
    loss_mask: Mask
    logprobs: Logprobs
    call_seqs: tuple[int, ...]
    """Seqs of the calls merged into the segment, ascending."""
    policy_version_min: int
    policy_version_max: int
    temperature: float
    """The one temperature all of the segment's calls were sampled at."""
    span_ids: tuple[str, ...]
    """Span ids of the segment's calls, in call_seqs order."""
    truncated: bool = False
    """True when `truncate` cut the segment; the calls are still all listed."""


@dataclass(frozen=True, slots=True)
class MergeResult:
    """The segments of one episode and how they came about."""

    segments: list[Segment]
    break_kinds: tuple[BreakKind, ...]
    """Why each segment after the first started: break_kinds[i] started segments[i + 1]."""
    duplicates_replaced: int
    """Calls dropped because the next call (in seq order) had the same prompt ids."""
    temperature_breaks: int
    """Breaks (among break_kinds) forced by a temperature change; counted as OTHER when the
    prompt did extend the segment, else classified by content as usual."""
    seq_conflicts: int
    """Seqs that arrived more than once with different contents (one copy was kept)."""

    @property
    def breaks(self) -> dict[BreakKind, int]:
        """Number of breaks of each kind; every kind is present."""
        return {kind: self.break_kinds.count(kind) for kind in BreakKind}


def merge(calls: Sequence[Call], *, decode: Decode | None = None) -> MergeResult:
    """Merge one episode attempt's calls into segments.

    Calls may come in any order and repeated (redelivered events); the result depends only
    on the set of calls. The same seq twice is one call; if the copies differ, the copy
    whose content sorts first (prompt ids, completion ids, log-probs as bytes, then policy
    version, temperature, span id) is kept and the seq is counted in `seq_conflicts`.
    Consecutive calls (in seq order) with identical prompt ids are a retry (or the choices
    of one n>1 request): only the last is kept. `decode` lets breaks be classified as
    RETOKENIZATION; without it they are CHAT_TEMPLATE or OTHER.

    Raises ValueError, naming the call's seq, when its ids are not 1-D uint32 arrays or
    its log-probs do not match its completion in shape.
    """
    for call in calls:
        _check(call)
    unique, seq_conflicts = _one_per_seq(calls)
    kept, replaced = _drop_retries(unique)
    segments: list[Segment] = []
    kinds: list[BreakKind] = []
    temperature_breaks = 0
    group: list[Call] = []
    last_prompt = b""  # the segment so far is last_prompt + group[-1]'s completion
    for call, prompt in kept:
        if group:
            last = group[-1]
            extends = prompt.startswith(last_prompt) and prompt.startswith(
                last.completion_ids.tobytes(), len(last_prompt)
            )
            same_temperature = call.temperature == group[0].temperature
            if not (extends and same_temperature):
                context = _ids(last)
                kinds.append(classify_break(context, call.prompt_ids, _spans(group), decode))
                temperature_breaks += not same_temperature
                segments.append(_segment(group, context))
                group = []
        group.append(call)
        last_prompt = prompt
    if group:
        segments.append(_segment(group, _ids(group[-1])))
    return MergeResult(segments, tuple(kinds), replaced, temperature_breaks, seq_conflicts)


def classify_break(
    context_ids: Ids,
    prompt_ids: Ids,
    completion_spans: Sequence[tuple[int, int]],
    decode: Decode | None = None,
) -> BreakKind:
    """Why `prompt_ids` does not extend `context_ids` (the segment so far).

    `completion_spans` are the [start, end) positions of the segment's completions in
    `context_ids`. Checked in order:

    - a prompt that does start with the context is no content break: OTHER (the segment
      was closed for another reason, such as a temperature change);
    - RETOKENIZATION: decode(context) is a prefix of decode(prompt), same text in other ids;
    - CHAT_TEMPLATE: the first differing position lies inside a completion span or at its
      end, so everything before that completion is unchanged and it was re-rendered;
    - OTHER: anything else (an earlier prompt or tool result changed, a new conversation).
    """
    at = _first_difference(context_ids, prompt_ids)
    if at == len(context_ids):
        return BreakKind.OTHER
    if decode is not None and decode(prompt_ids.tolist()).startswith(decode(context_ids.tolist())):
        return BreakKind.RETOKENIZATION
    if any(start <= at <= end for start, end in completion_spans):
        return BreakKind.CHAT_TEMPLATE
    return BreakKind.OTHER


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


def _one_per_seq(calls: Sequence[Call]) -> tuple[list[Call], int]:
    """One call per seq, ascending, and the number of seqs whose copies differed."""
    unique: list[Call] = []
    conflicted: set[int] = set()
    for call in sorted(calls, key=attrgetter("seq")):
        if not unique or unique[-1].seq != call.seq:
            unique.append(call)
            continue
        held, other = _content(unique[-1]), _content(call)
        if other != held:
            conflicted.add(call.seq)
            if other < held:
                unique[-1] = call
    return unique, len(conflicted)


def _content(call: Call) -> tuple[bytes, bytes, bytes, int, float, str]:
    return (
        call.prompt_ids.tobytes(),
        call.completion_ids.tobytes(),
        call.logprobs.tobytes(),
        call.policy_version,
        call.temperature,
        call.span_id,
    )


def _drop_retries(calls: list[Call]) -> tuple[list[tuple[Call, bytes]], int]:
    """Keep the last of each run of consecutive calls with identical prompt ids; each kept
    call comes with its prompt ids as bytes."""
    kept: list[tuple[Call, bytes]] = []
    replaced = 0
    for call in calls:
        prompt = call.prompt_ids.tobytes()
        if kept and kept[-1][1] == prompt:
            kept[-1] = (call, prompt)
            replaced += 1
        else:
            kept.append((call, prompt))
    return kept, replaced


def _first_difference(a: Ids, b: Ids) -> int:
    """First position where a and b differ; the shorter length when one prefixes the other."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _ids(call: Call) -> Ids:
    return np.concatenate((call.prompt_ids, call.completion_ids))


def _spans(group: list[Call]) -> list[tuple[int, int]]:
    """[start, end) of each call's completion within the segment's token ids."""
    return [(len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)) for c in group]


def _segment(group: list[Call], token_ids: Ids) -> Segment:
    """The segment of `group`, whose last call's prompt + completion is `token_ids`."""
    loss_mask = np.zeros(len(token_ids), dtype=np.bool_)
    logprobs = np.zeros(len(token_ids), dtype=np.float32)
    for call in group:
        start = len(call.prompt_ids)
        end = start + len(call.completion_ids)
        loss_mask[start:end].fill(True)
        logprobs[start:end] = call.logprobs
    versions = [c.policy_version for c in group]
    return Segment(
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        call_seqs=tuple(c.seq for c in group),
        policy_version_min=min(versions),
        policy_version_max=max(versions),
        temperature=group[0].temperature,
        span_ids=tuple(c.span_id for c in group),
    )
