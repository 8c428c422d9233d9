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
break is compared with at most _RECENT + 2 earlier chains, and `decode` runs only at
breaks: the Python work is linear in the episode's calls however many chains it has.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens included (used to classify breaks, never to train)."""

Ids = npt.NDArray[np.uint32]
Mask = npt.NDArray[np.bool_]
Logprobs = npt.NDArray[np.float32]

_U32 = np.dtype(np.uint32)
_TAIL = 4
"""Ids compared at the end of a candidate prefix before the full comparison."""
_COLUMNS = np.arange(_TAIL)
_SCAN = 16
"""Earlier contexts tried one by one for a call's parent before the vector filter."""
_RECENT = 32
"""A new chain's break is classified against the chains most recently extended before it
(and the first chain, and the chain it branched from): all of them in an episode of up to
this many chains, so the cost stays linear in the calls however many chains there are."""
_WINDOW = 24
"""Ids decoded on each side of a break's first difference for its report."""
_SURVIVES = 0.5
"""Share of the context's inserted ids after a difference that must reappear in the new
prompt for the break to be a re-render rather than a compaction."""


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
    """Hex span id of the gateway's span for the call (trace link; the choices of one
    request share it)."""
    constrained: bool = False
    """Sampled under constrained decoding (ModelCall.constrained): its completion stays in
    its chain as context, never trained."""
    source: object = None
    """What the call was read from (opaque here: the builder's ModelCall)."""


class BreakKind(StrEnum):
    """Why a chain other than the first started (see the module docstring)."""

    CHAT_TEMPLATE = "chat_template"
    RETOKENIZATION = "retokenization"
    COMPACTION = "compaction"
    SIDE_CHAIN = "side_chain"
    OTHER = "other"


class Dropped(StrEnum):
    """Why merging left a call's completion tokens untrained."""

    RETRIED = "retried"
    UNUSED_CHOICE = "unused_choice"
    SEQ_CONFLICT = "seq_conflict"
    """Another copy of the same seq, with other contents, was kept."""
    CONSTRAINED = "constrained"
    """Sampled under constrained decoding: log-probs the trainer cannot recompute."""


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


@dataclass(slots=True)
class _Node:
    call: Call
    prompt: bytes
    context: bytes
    parent: int = -1
    """Index of the parent node, -1 for a root."""
    children: list[int] = dataclasses.field(default_factory=list)
    height: int = 0
    """Calls on the longest line of descendants from this one."""
    head: bool = True
    """Starts a chain."""


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
    nodes = _tree(unique)
    nodes = _drop_alternatives(nodes, dropped, dropped_calls)
    chains = _chains(nodes)
    segments = [_segment([nodes[i].call for i in chain]) for chain in chains]
    for node in nodes:
        if node.call.constrained:
            dropped[Dropped.CONSTRAINED] += len(node.call.completion_ids)
            dropped_calls[Dropped.CONSTRAINED] += 1
    breaks = tuple(_breaks(nodes, chains, decode))
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


# -- the tree ---------------------------------------------------------------------------------


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


def _tree(calls: list[Call]) -> list[_Node]:
    """The calls (ascending seq) as nodes, each with its parent: the earlier call whose
    context is the longest prefix of its prompt (the latest such call on a tie).

    Earlier contexts are tried longest first; a candidate is compared byte for byte only
    when its last _TAIL ids match the prompt's at the same place. The first _SCAN are tried
    one by one (the parent is almost always among them); the rest, if need be, are
    filtered by their tails in one vector operation, so an episode of many chains costs
    linear, not quadratic, Python work."""
    nodes: list[_Node] = []
    by_length: list[int] = []  # node indexes, longest context first (latest first on a tie)
    lengths = np.zeros(len(calls), dtype=np.int64)
    tails = np.zeros((len(calls), _TAIL), dtype=np.uint32)  # right-aligned
    for index, call in enumerate(calls):
        prompt = call.prompt_ids.tobytes()
        node = _Node(call, prompt, prompt + call.completion_ids.tobytes())
        node.parent = _first_prefix(node, nodes, by_length[:_SCAN])
        if node.parent < 0 and index > _SCAN:
            tried = set(by_length[:_SCAN])
            fits = np.flatnonzero(lengths[:index] <= len(call.prompt_ids))
            if fits.size and call.prompt_ids.size:
                positions = lengths[fits, None] - _TAIL + _COLUMNS
                seen = call.prompt_ids[np.maximum(positions, 0)]
                fits = fits[((seen == tails[fits]) | (positions < 0)).all(axis=1)]
            if fits.size > 1:
                fits = fits[np.lexsort((-fits, -lengths[fits]))]
            rest = [j for j in fits.tolist() if j not in tried]
            node.parent = _first_prefix(node, nodes, rest, tails_checked=True)
        lengths[index] = len(call.prompt_ids) + len(call.completion_ids)
        tail = call.completion_ids[-_TAIL:]
        if len(tail) < _TAIL:
            tail = np.concatenate((call.prompt_ids[len(tail) - _TAIL :], tail))
        tails[index, _TAIL - len(tail) :] = tail
        nodes.append(node)
        _insert(by_length, index, nodes)
    return nodes


def _first_prefix(
    node: _Node, nodes: list[_Node], candidates: list[int], tails_checked: bool = False
) -> int:
    """The first of `candidates` whose context is a prefix of the node's prompt, or -1."""
    prompt = node.prompt
    for j in candidates:
        context = nodes[j].context
        n = len(context)
        if n > len(prompt) or (n == len(prompt) and not nodes[j].call.completion_ids.size):
            continue  # longer, or an alternative of this call with an empty completion
        tail = _TAIL * 4  # bytes
        if not tails_checked and prompt[max(0, n - tail) : n] != context[-tail:]:
            continue
        if prompt.startswith(context):
            return j
    return -1


def _insert(order: list[int], index: int, nodes: list[_Node]) -> None:
    """Put node `index` into `order` (longest context first, later nodes first on a tie)."""
    n = len(nodes[index].context)
    lo, hi = 0, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(nodes[order[mid]].context) > n:
            lo = mid + 1
        else:
            hi = mid
    order.insert(lo, index)


def _drop_alternatives(
    nodes: list[_Node], dropped: Counter[Dropped], dropped_calls: Counter[Dropped]
) -> list[_Node]:
    """The nodes without the alternatives nobody used (re-indexed, children linked)."""
    extended = {node.parent for node in nodes if node.parent >= 0}
    alternatives: dict[bytes, list[int]] = {}
    for i, node in enumerate(nodes):
        alternatives.setdefault(node.prompt, []).append(i)
    drop: set[int] = set()
    for members in alternatives.values():
        if len(members) < 2:
            continue
        used = [i for i in members if i in extended] or members[-1:]
        spans = {nodes[i].call.span_id for i in used}
        for i in members:
            if i in used:
                continue
            call = nodes[i].call
            reason = Dropped.UNUSED_CHOICE if call.span_id in spans else Dropped.RETRIED
            dropped[reason] += len(call.completion_ids)
            dropped_calls[reason] += 1
            drop.add(i)
    index = {old: new for new, old in enumerate(i for i in range(len(nodes)) if i not in drop)}
    kept = []
    for old, node in enumerate(nodes):
        if old in drop:
            continue
        # A dropped node has no children, so every kept node's parent is kept.
        node.parent = index[node.parent] if node.parent >= 0 else -1
        kept.append(node)
    for i, node in enumerate(kept):
        if node.parent >= 0:
            kept[node.parent].children.append(i)
    return kept


def _chains(nodes: list[_Node]) -> list[list[int]]:
    """The chains (node indexes, ascending seq), ordered by their first calls."""
    for i in range(len(nodes) - 1, -1, -1):  # children come after their parents
        node = nodes[i]
        node.height = 1 + max((nodes[c].height for c in node.children), default=0)
    for node in nodes:
        same = [c for c in node.children if nodes[c].call.temperature == node.call.temperature]
        if same:
            nodes[max(same, key=lambda c: (nodes[c].height, -c))].head = False
    chains: list[list[int]] = []
    of: dict[int, int] = {}
    for i, node in enumerate(nodes):
        if node.head:
            of[i] = len(chains)
            chains.append([i])
        else:
            of[i] = of[node.parent]
            chains[of[i]].append(i)
    return chains


# -- breaks -----------------------------------------------------------------------------------


def _breaks(nodes: list[_Node], chains: list[list[int]], decode: Decode | None) -> list[Break]:
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
    nodes: list[_Node],
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
        shared = _first_difference(_ids(call), prompt_ids)
        if shared > at:
            best, at = tip, shared
    last = nodes[best]
    context_ids = _ids(last.call)
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


def _older_goes_on(nodes: list[_Node], parents: npt.NDArray[np.int64], head: int) -> bool:
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
    """Whether most of the context's inserted ids from `at` on reappear in the prompt."""
    inside = np.zeros(len(context_ids), dtype=np.bool_)
    for start, end in spans:
        inside[start:end] = True
    rest = prompt_ids[at:].tobytes()
    total = found = 0
    after = at + 1  # the id at `at` itself is the one that changed
    for start, end in _runs(~inside[after:]):
        run = context_ids[after + start : after + end]
        total += len(run)
        # The run's ends may be tokenized with their neighbours: look for its middle.
        middle = run[1:-1] if len(run) > 2 else run
        if _find_ids(rest, middle.tobytes()):
            found += len(run)
    return total == 0 or found >= _SURVIVES * total


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


# -- sequences --------------------------------------------------------------------------------


def _first_difference(a: Ids, b: Ids) -> int:
    """First position where a and b differ; the shorter length when one prefixes the other."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def _ids(call: Call) -> Ids:
    return np.concatenate((call.prompt_ids, call.completion_ids))


def _spans(chain: list[Call]) -> list[tuple[int, int]]:
    """[start, end) of each call's completion within the chain's token ids."""
    return [(len(c.prompt_ids), len(c.prompt_ids) + len(c.completion_ids)) for c in chain]


def _segment(chain: list[Call]) -> Segment:
    """The sequence of `chain`: its last call's prompt + completion, with masks."""
    token_ids = _ids(chain[-1])
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
