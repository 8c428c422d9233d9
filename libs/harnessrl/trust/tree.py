"""An episode's calls as a tree, cut into chains: steps 1-3 of merging.py's docstring
(parents, retries and choices, chains). Pure; the Python work is linear in the calls."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from harnessrl.trust.calls import Call, Ids


class Dropped(StrEnum):
    """Why merging left a call's completion tokens untrained."""

    RETRIED = "retried"
    UNUSED_CHOICE = "unused_choice"
    SEQ_CONFLICT = "seq_conflict"
    """Another copy of the same seq, with other contents, was kept."""
    CONSTRAINED = "constrained"
    """Sampled under constrained decoding: log-probs the trainer cannot recompute."""


_TAIL = 4
"""Ids compared at the end of a candidate prefix before the full comparison."""


_COLUMNS = np.arange(_TAIL)


_SCAN = 16
"""Earlier contexts tried one by one for a call's parent before the vector filter."""


@dataclass(slots=True)
class CallNode:
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


def build_tree(calls: list[Call]) -> list[CallNode]:
    """The calls (ascending seq) as nodes, each with its parent: the earlier call whose
    context is the longest prefix of its prompt (the latest such call on a tie).

    Earlier contexts are tried longest first; a candidate is compared byte for byte only
    when its last _TAIL ids match the prompt's at the same place. The first _SCAN are tried
    one by one (the parent is almost always among them); the rest, if need be, are
    filtered by their tails in one vector operation, so an episode of many chains costs
    linear, not quadratic, Python work."""
    nodes: list[CallNode] = []
    by_length: list[int] = []  # node indexes, longest context first (latest first on a tie)
    lengths = np.zeros(len(calls), dtype=np.int64)
    tails = np.zeros((len(calls), _TAIL), dtype=np.uint32)  # right-aligned
    for index, call in enumerate(calls):
        prompt = call.prompt_ids.tobytes()
        node = CallNode(call, prompt, prompt + call.completion_ids.tobytes())
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
    node: CallNode, nodes: list[CallNode], candidates: list[int], tails_checked: bool = False
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


def _insert(order: list[int], index: int, nodes: list[CallNode]) -> None:
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


def drop_alternatives(
    nodes: list[CallNode], dropped: Counter[Dropped], dropped_calls: Counter[Dropped]
) -> list[CallNode]:
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


def cut_chains(nodes: list[CallNode]) -> list[list[int]]:
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


def ids_of(call: Call) -> Ids:
    return np.concatenate((call.prompt_ids, call.completion_ids))
