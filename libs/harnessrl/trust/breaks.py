"""Why a chain other than an episode's first started: step 4 of merging.py's docstring.

Each new chain is compared with the earlier chain whose context, as it stood when the
chain began, shares the longest prefix with its first prompt, and classified by what the
harness did to that context (a side call, a re-rendered turn, a compaction, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from harnessrl.trust.calls import Call, Decode, Ids, Mask
from harnessrl.trust.tree import CallNode, ids_of


class BreakKind(StrEnum):
    """Why a chain other than the first started (see the module docstring)."""

    CHAT_TEMPLATE = "chat_template"
    RETOKENIZATION = "retokenization"
    COMPACTION = "compaction"
    SIDE_CHAIN = "side_chain"
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class Break:
    """Where one chain started, against the nearest earlier context."""

    kind: BreakKind
    seq: int
    """The call that started the chain."""
    nearest_seq: int
    """The call whose context it was compared with (-1: there was none)."""
    position: int
    """First position where the call's prompt differs from that context."""
    recorded: str = ""
    """The context around `position`, decoded (empty without a decoder)."""
    sent: str = ""
    """The call's prompt around `position`, decoded."""
    temperature_change: bool = False
    """It extends the nearest chain but was sampled at another temperature."""


_RECENT = 32
"""A new chain's break is classified against the chains most recently extended before it
(and the first chain, and the chain it branched from): all of them in an episode of up to
this many chains, so the cost stays linear in the calls however many chains there are."""


_WINDOW = 24
"""Ids decoded on each side of a break's first difference for its report."""


_SURVIVES = 0.5
"""Share of the context's inserted ids after a difference that must reappear in the new
prompt for the break to be a re-render rather than a compaction."""


def classify_break(
    context_ids: Ids,
    prompt_ids: Ids,
    completion_spans: Sequence[tuple[int, int]],
    decode: Decode | None = None,
) -> BreakKind:
    """What replacing `context_ids` (a chain so far) by `prompt_ids` did, by content alone.

    `completion_spans` are the [start, end) positions of the completions in `context_ids`.
    Checked in order:

    - a prompt that starts with the whole context: OTHER (the chain was left for another
      reason, such as a temperature change);
    - RETOKENIZATION: decode(context) is a prefix of decode(prompt), same text in other ids;
    - COMPACTION: of the inserted ids (outside completions) the context has after the first
      difference, less than half reappear, in runs, in the rest of the prompt;
    - CHAT_TEMPLATE: the first difference lies inside a completion span or at its end, so
      everything before that completion is unchanged and it was re-rendered;
    - OTHER: anything else (an earlier prompt or tool result changed in place).
    """
    at = _first_difference(context_ids, prompt_ids)
    if at == len(context_ids):
        return BreakKind.OTHER
    if decode is not None and decode(prompt_ids.tolist()).startswith(decode(context_ids.tolist())):
        return BreakKind.RETOKENIZATION
    if not _survives(context_ids, prompt_ids, completion_spans, at):
        return BreakKind.COMPACTION
    if any(start <= at <= end for start, end in completion_spans):
        return BreakKind.CHAT_TEMPLATE
    return BreakKind.OTHER


def find_breaks(
    nodes: list[CallNode], chains: list[list[int]], decode: Decode | None
) -> list[Break]:
    """The break that started each chain after the first (see _break)."""
    of = {i: k for k, chain in enumerate(chains) for i in chain}
    heads = {chain[0]: k for k, chain in enumerate(chains)}
    parents = np.array([node.parent for node in nodes], dtype=np.int64)
    latest: dict[int, int] = {}  # chain -> its latest node so far, least recently extended first
    out: list[Break] = []
    for i, node in enumerate(nodes):
        k = heads.get(i, 0)
        if k:
            tips = [latest[c] for c in list(latest)[-_RECENT:]]
            tips.append(latest[0])
            if node.parent >= 0:
                tips.append(latest[of[node.parent]])
            out.append(
                _break(
                    nodes,
                    i,
                    sorted(set(tips)),
                    parents=parents,
                    chains=chains,
                    of=of,
                    decode=decode,
                )
            )
        chain = of[i]
        latest.pop(chain, None)
        latest[chain] = i
    return out


def _break(
    nodes: list[CallNode],
    head: int,
    tips: list[int],
    *,
    parents: npt.NDArray[np.int64],
    chains: list[list[int]],
    of: dict[int, int],
    decode: Decode | None,
) -> Break:
    """The break that started the chain whose first call is `head`, against the earlier
    chains as they stood then (their latest calls before it, `tips`): the one whose context
    shares the longest prefix with the call's prompt (the latest on a tie)."""
    node = nodes[head]
    prompt_ids = node.call.prompt_ids
    best, at = -1, -1
    for tip in sorted(tips, reverse=True):  # the latest first: it wins a tie
        call = nodes[tip].call
        if best >= 0 and not _same_at(call, prompt_ids, at):
            continue  # shares at most `at` ids: cannot share more than the best
        shared = _first_difference(ids_of(call), prompt_ids)
        if shared > at:
            best, at = tip, shared
    last = nodes[best]
    context_ids = ids_of(last.call)
    changed = False
    if at == len(context_ids):  # it extends that chain, which went on without it
        changed = node.call.temperature != last.call.temperature
        kind = BreakKind.OTHER if changed else BreakKind.SIDE_CHAIN
    elif _older_goes_on(nodes, parents, head):
        kind = BreakKind.SIDE_CHAIN
    else:
        spans = _spans([nodes[i].call for i in chains[of[best]] if i <= best])
        kind = classify_break(context_ids, prompt_ids, spans, decode)
        if kind == BreakKind.COMPACTION and not node.children:
            kind = BreakKind.SIDE_CHAIN  # a compaction goes on; a call nothing extends is aside
    recorded = sent = ""
    if decode is not None:
        lo = max(0, at - _WINDOW)
        recorded = decode(context_ids[lo : at + _WINDOW].tolist())
        sent = decode(prompt_ids[lo : at + _WINDOW].tolist())
    return Break(kind, node.call.seq, last.call.seq, at, recorded, sent, changed)


def _same_at(call: Call, prompt_ids: Ids, at: int) -> bool:
    """Whether the call's context and `prompt_ids` both have an id at `at`, the same one."""
    if at >= len(prompt_ids):
        return False
    if at < len(call.prompt_ids):
        return bool(call.prompt_ids[at] == prompt_ids[at])
    rest = at - len(call.prompt_ids)
    return rest < len(call.completion_ids) and bool(call.completion_ids[rest] == prompt_ids[at])


def _older_goes_on(nodes: list[CallNode], parents: npt.NDArray[np.int64], head: int) -> bool:
    """Whether a later call extends a call older than `head` that is not on its own line
    (the contexts its prompt starts with): a chain begun before it goes on after it."""
    later = parents[head + 1 :]
    older = later[(later >= 0) & (later < head)]
    if not older.size:
        return False
    ancestors = []
    at = nodes[head].parent
    while at >= 0:
        ancestors.append(at)
        at = nodes[at].parent
    return bool(np.isin(older, ancestors, invert=True).any())


def _survives(context_ids: Ids, prompt_ids: Ids, spans: Sequence[tuple[int, int]], at: int) -> bool:
    """Whether most of the context's inserted ids from `at` on reappear in the prompt.

    A long run is matched chunk by chunk, so an edit inside it (a request id changed in the
    system prompt, the rest of the run unchanged) costs only the chunks it touches; a short
    run is matched whole (its middle: its ends may be tokenized with their neighbours)."""
    inside = np.zeros(len(context_ids), dtype=np.bool_)
    for start, end in spans:
        inside[start:end] = True
    rest_ids = prompt_ids[at:]
    rest = rest_ids.tobytes()
    grams: set[bytes] | None = None
    total = found = 0
    after = at + 1  # the id at `at` itself is the one that changed
    for start, end in _runs(~inside[after:]):
        run = context_ids[after + start : after + end]
        if len(run) >= 2 * _CHUNK:
            if grams is None:
                grams = _grams(rest_ids)
            chunks = run[: len(run) // _CHUNK * _CHUNK].reshape(-1, _CHUNK)
            total += chunks.size
            found += _CHUNK * sum(chunk.tobytes() in grams for chunk in chunks)
            continue
        total += len(run)
        middle = run[1:-1] if len(run) > 2 else run
        if _find_ids(rest, middle.tobytes()):
            found += len(run)
    return total == 0 or found >= _SURVIVES * total


_CHUNK = 8
"""Ids per chunk when a long run of inserted ids is looked for in the new prompt."""


def _grams(ids: Ids) -> set[bytes]:
    """Every _CHUNK consecutive ids of `ids`, as bytes (one set, built in one pass)."""
    if len(ids) < _CHUNK:
        return set()
    windows = np.lib.stride_tricks.sliding_window_view(ids, _CHUNK)
    flat = np.ascontiguousarray(windows).view(np.dtype((np.void, 4 * _CHUNK))).ravel()
    return {w.tobytes() for w in flat}


def _runs(mask: Mask) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `mask`."""
    padded = np.concatenate(([False], mask, [False]))
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist(), strict=True))


def _find_ids(haystack: bytes, needle: bytes) -> bool:
    """Whether uint32 ids `needle` occur in `haystack` at an id boundary."""
    at = haystack.find(needle)
    while at >= 0:
        if at % 4 == 0:
            return True
        at = haystack.find(needle, at + 1)
    return False


def _first_difference(a: Ids, b: Ids) -> int:
    """First position where a and b differ; the shorter length when one prefixes the other."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _spans(chain: list[Call]) -> list[tuple[int, int]]:
    """[start, end) of each call's completion within the chain's token ids."""
    return [(len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)) for c in chain]
