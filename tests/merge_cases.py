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

from harnessrl.services.sample_builder.merging import BreakKind, Call

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
    kinds: list[BreakKind]
    replaced: int
    temperature_breaks: int

    @property
    def kept(self) -> list[Call]:
        return [c for s in self.segments for c in s.calls]


ACTIONS = ["extend", "extend", "extend", "rewrite", "rerender", "temperature"]


@st.composite
def episodes(draw: st.DrawFn) -> Episode:
    """1-8 kept calls; each after the first extends (tool output / user turn inserted),
    rewrites the context (OTHER), re-renders an earlier completion (CHAT_TEMPLATE) or
    changes temperature (OTHER); any kept call may follow 0-2 discarded retries."""
    episode = Episode(calls=[], segments=[], kinds=[], replaced=0, temperature_breaks=0)
    version = 0
    segment = Expected()
    temperature = draw(st.sampled_from(TEMPERATURES))
    for turn in range(draw(st.integers(1, 8))):
        action = "start" if turn == 0 else draw(st.sampled_from(ACTIONS))
        if action == "rerender" and not any(e > s for s, e in segment.spans):
            action = "rewrite"
        previous = episode.calls[-1].prompt_ids.tolist() if episode.calls else []
        inserted, prompt = _prompt(draw, action, segment, previous, MARKER + turn)
        if action == "temperature":
            temperature = TEMPERATURES[1 - TEMPERATURES.index(temperature)]
            episode.temperature_breaks += 1
        for _ in range(draw(st.integers(0, 2))):
            retry_temperature = draw(st.sampled_from(TEMPERATURES))
            retry = make_call(len(episode.calls), prompt, draw(ids()), version=version)
            episode.calls.append(replace(retry, temperature=retry_temperature))
            episode.replaced += 1
        # Replicas may lag behind one another: versions need not grow with seq.
        version = max(0, version + draw(st.integers(-1, 2)))
        call = make_call(
            len(episode.calls), prompt, draw(ids()), version=version, temperature=temperature
        )
        episode.calls.append(call)
        if action == "extend":
            segment.add(inserted, call)
            continue
        if action != "start":
            episode.segments.append(segment)
            kind = BreakKind.CHAT_TEMPLATE if action == "rerender" else BreakKind.OTHER
            episode.kinds.append(kind)
        segment = Expected()
        segment.add(prompt, call)
    episode.segments.append(segment)
    return episode


def _prompt(
    draw: st.DrawFn, action: str, segment: Expected, previous: list[int], marker: int
) -> tuple[list[int], list[int]]:
    """(ids inserted after the segment, the whole prompt) of the next call."""
    if action == "start":
        return [], draw(ids(1, 8))  # non-empty: position 0 is never inside a completion
    if action == "rewrite":
        outside = [
            p for p in range(len(segment.ids)) if not any(s <= p <= e for s, e in segment.spans)
        ]
        at = draw(st.sampled_from(outside))
        return [], [*segment.ids[:at], marker, *draw(ids(0, 5))]
    if action == "rerender":
        at = draw(st.sampled_from([p for s, e in segment.spans for p in range(s, e)]))
        return [], [*segment.ids[:at], marker, *segment.ids[at + 1 :], *draw(ids(0, 5))]
    inserted = draw(ids(0, 5))
    if segment.ids + inserted == previous:
        inserted.append(draw(VOCAB))  # else it would be a retry of the call before
    return inserted, segment.ids + inserted


def injective_decode(token_ids: object) -> str:
    """One distinct character per id: text prefixes are exactly id prefixes."""
    assert isinstance(token_ids, list)
    return "".join(chr(0x100 + i) for i in token_ids)
