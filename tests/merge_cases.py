"""Generated episodes for merging tests: the calls, and the segments they must merge into.

`episodes()` plays out a conversation turn by turn and records, beside the calls, what the
merge must produce: the expected segments are written down from how each turn was made
(inserted tokens mask 0, completion mask 1, a break starts over with the whole prompt mask
0), not recomputed from the calls, so the test does not repeat the algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
from hypothesis import strategies as st

from harnessrl.trust.merging import BreakKind, Call

VOCAB = st.integers(0, 30)
MARKER = 1000  # ids from here on never come out of VOCAB: each break writes a fresh one
TEMPERATURES = (0.6, 1.0)


def ids(min_size: int = 0, max_size: int = 6) -> st.SearchStrategy[list[int]]:
    return st.lists(VOCAB, min_size=min_size, max_size=max_size)


def make_call(
    seq: int,
    prompt: list[int],
    completion: list[int],
    *,
    version: int = 0,
    temperature: float = 1.0,
) -> Call:
    """A call whose log-probs are distinct per (seq, position), so any misplacement shows."""
    return Call(
        seq=seq,
        prompt_ids=np.array(prompt, dtype=np.uint32),
        completion_ids=np.array(completion, dtype=np.uint32),
        logprobs=(-(np.arange(len(completion)) + 1 + 64 * seq) / 1024).astype(np.float32),
        policy_version=version,
        temperature=temperature,
        span_id=f"span-{seq}",
    )


@dataclass
class Expected:
    """A segment as the conversation built it."""

    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    continued: bool = False
    """A call at another temperature extends its last call."""

    def add(self, inserted: list[int], call: Call) -> None:
        self.ids += inserted
        self.mask += [False] * len(inserted)
        self.logprobs += [0.0] * len(inserted)
        start = len(self.ids)
        self.ids += call.completion_ids.tolist()
        self.mask += [True] * len(call.completion_ids)
        self.logprobs += call.logprobs.tolist()
        self.spans.append((start, len(self.ids)))
        self.calls.append(call)


@dataclass
class Episode:
    calls: list[Call]
    """Every call made, in seq order, retries included."""
    segments: list[Expected]
    """The chains, in the order of their first calls."""
    kinds: list[BreakKind]
    replaced: int
    temperature_breaks: int
    choices: set[int] = field(default_factory=set)
    """Seqs of the discarded calls that were other choices of a kept call's request."""

    @property
    def kept(self) -> list[Call]:
        return [c for s in self.segments for c in s.calls]

    @property
    def captured(self) -> int:
        return sum(len(c.completion_ids) for c in self.calls)

    def discarded(self, choices: bool) -> int:
        """Completion tokens of the retries (or, `choices`, the unused choices)."""
        kept = {c.seq for c in self.kept}
        return sum(
            len(c.completion_ids)
            for c in self.calls
            if c.seq not in kept and (c.seq in self.choices) == choices
        )


ACTIONS = ["extend", "extend", "extend", "rewrite", "rerender", "compact", "temperature", "side"]
RETRIED = 900
"""First id of every discarded retry's completion (no prompt ever holds it)."""


@st.composite
def episodes(draw: st.DrawFn) -> Episode:
    """1-8 turns of a main conversation; each after the first extends it (tool output / user
    turn inserted), rewrites an inserted id in place (OTHER), re-renders an earlier
    completion (CHAT_TEMPLATE), compacts it (COMPACTION: the context from some point on
    replaced by new ids), changes temperature (OTHER), or makes an independent side call
    (SIDE_CHAIN: a conversation of its own, after which the main one goes on); any main call
    may follow 0-2 discarded retries."""
    episode = Episode(calls=[], segments=[], kinds=[], replaced=0, temperature_breaks=0)
    version = 0
    segment = Expected()
    episode.segments.append(segment)
    temperature = draw(st.sampled_from(TEMPERATURES))
    turns = draw(st.integers(1, 8))
    action = "start"
    for turn in range(turns):
        if turn:
            action = "extend" if action == "side" else draw(st.sampled_from(ACTIONS))
        if action == "side" and turn == turns - 1:
            action = "extend"  # a side call is followed by the main conversation
        fresh = [MARKER + 16 * turn + k for k in range(draw(st.integers(1, 4)))]
        if action == "side":
            call = make_call(len(episode.calls), fresh, draw(ids()), version=version)
            episode.calls.append(replace(call, temperature=temperature))
            side = Expected()
            side.add(fresh, episode.calls[-1])
            episode.segments.append(side)
            episode.kinds.append(BreakKind.SIDE_CHAIN)
            continue
        previous = segment.calls[-1].prompt_ids.tolist() if segment.calls else []
        # A break may not keep the whole context of a call of another chain: the call would
        # extend that chain (and could go on with it) instead of starting its own.
        contexts = [
            c.prompt_ids.tolist() + c.completion_ids.tolist()
            for e in episode.segments
            if e is not segment
            for c in e.calls
        ]
        room = min((len(c) for c in contexts if segment.ids[: len(c)] == c), default=1 << 30)
        action, inserted, prompt = _prompt(draw, action, segment, previous, fresh, room)
        if action == "temperature":
            temperature = TEMPERATURES[1 - TEMPERATURES.index(temperature)]
            episode.temperature_breaks += 1
        _retries(draw, episode, prompt, version)
        # Replicas may lag behind one another: versions need not grow with seq.
        version = max(0, version + draw(st.integers(-1, 2)))
        call = make_call(
            len(episode.calls), prompt, draw(ids()), version=version, temperature=temperature
        )
        episode.calls.append(call)
        if action == "extend":
            segment.add(inserted, call)
            continue
        if action == "temperature":
            segment.continued = True  # its last call has a child, at another temperature
        if action != "start":
            episode.kinds.append(_KINDS[action])
            segment = Expected()
            episode.segments.append(segment)
        segment.add(prompt, call)
    _compactions_go_on(episode)
    return episode


def _retries(draw: st.DrawFn, episode: Episode, prompt: list[int], version: int) -> None:
    """0-2 discarded calls with `prompt` before the kept one: retries, or the other choices
    of its request (they share its span)."""
    retries = draw(st.integers(0, 2))
    choices = draw(st.booleans())
    kept_seq = len(episode.calls) + retries
    for _ in range(retries):
        completion = [RETRIED, *draw(ids(0, 3))]
        retry = make_call(len(episode.calls), prompt, completion, version=version)
        retry = replace(retry, temperature=draw(st.sampled_from(TEMPERATURES)))
        if choices:
            retry = replace(retry, span_id=f"span-{kept_seq}")
            episode.choices.add(retry.seq)
        episode.calls.append(retry)
        episode.replaced += 1


def _compactions_go_on(episode: Episode) -> None:
    """A compaction that no later call extends is a side call (merging.py)."""
    for k, kind in enumerate(episode.kinds):
        compacted = episode.segments[k + 1]
        if kind == BreakKind.COMPACTION and len(compacted.calls) == 1 and not compacted.continued:
            episode.kinds[k] = BreakKind.SIDE_CHAIN


_KINDS = {
    "rewrite": BreakKind.OTHER,
    "rerender": BreakKind.CHAT_TEMPLATE,
    "compact": BreakKind.COMPACTION,
    "temperature": BreakKind.OTHER,
}


def _prompt(
    draw: st.DrawFn,
    action: str,
    segment: Expected,
    previous: list[int],
    fresh: list[int],
    room: int,
) -> tuple[str, list[int], list[int]]:
    """(the action taken, ids inserted after the segment, the whole prompt) of the next
    main call. A break changes an id before `room` (other chains' shortest context)."""
    if action == "start":
        return action, [], draw(ids(1, 8))  # non-empty: position 0 is never in a completion
    # Breaks change the segment's first prompt or first completion, so that the new prompt
    # extends none of the calls after the first: which line of a branch goes on is then
    # not a question (test_merging.py covers branches by hand).
    first, end = segment.spans[0]
    if action == "rerender" and min(end, room) > first:
        at = draw(st.integers(first, min(end, room) - 1))
        return action, [], [*segment.ids[:at], fresh[0], *segment.ids[at + 1 :], *draw(ids())]
    if action in ("rewrite", "rerender") and min(first, room) > 0:
        at = draw(st.integers(0, min(first, room) - 1))
        prompt = [*segment.ids[:at], fresh[0], *segment.ids[at + 1 :], *draw(ids())]
        return "rewrite", [], prompt
    if action == "compact":
        # From some id on, every inserted id after it is gone: replaced by new ones.
        inside = [any(s <= p < e for s, e in segment.spans) for p in range(len(segment.ids))]
        cuts = [p for p in range(min(end, room)) if not all(inside[p + 1 :])]
        if cuts:
            return action, [], [*segment.ids[: draw(st.sampled_from(cuts))], *fresh]
    if action in ("rewrite", "rerender", "compact"):
        action = "extend"  # no room for a break of that kind here
    inserted = draw(ids(0, 5))
    if segment.ids + inserted == previous:
        inserted.append(draw(VOCAB))  # else it would be a retry of the call before
    return action, inserted, segment.ids + inserted


def injective_decode(token_ids: object) -> str:
    """One distinct character per id: text prefixes are exactly id prefixes."""
    assert isinstance(token_ids, list)
    return "".join(chr(0x100 + i) for i in token_ids)
