"""A ready (or timed-out) group becomes one GroupSamples, deterministically.

Episodes are taken in group order; each is kept or dropped with a reason (invalid, failed,
reward missing, flagged, too long, incomplete); the kept ones' calls are merged into chains
from their recorded token ids (merging.py), the advantages computed from their rewards, and
every sample of an episode, however many chains it has, stamped with its episode's
advantage. The group's token books say where each captured completion token went: trained,
or dropped by merging, by the length limit, with its episode or with the whole group.
Nothing here reads a clock or a random source: the same group always gives the same bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from harnessrl.events import varint
from harnessrl.trust.advantages import Estimator, advantages
from harnessrl.trust.group import Group, GroupEpisode
from harnessrl.trust.merging import (
    BreakKind,
    Call,
    Dropped,
    MergeResult,
    Segment,
    merge,
    truncate,
)
from harnessrl.v1 import events_pb2 as pb

Decode = Callable[[Sequence[int]], str]


class Rules(Protocol):
    """What decides which episodes are trained and how (the sample builder's settings)."""

    @property
    def estimator(self) -> Estimator:
        """The advantage estimator (advantages.py)."""

    @property
    def eps(self) -> float:
        """Added to the group's reward std by grpo."""

    @property
    def keep_failed(self) -> bool:
        """Train on episodes whose harness failed or timed out."""

    @property
    def missing_reward(self) -> str:
        """ "drop" an episode whose reward is missing, or "fill" it with `fill_value`."""

    @property
    def fill_value(self) -> float: ...

    @property
    def drop_flags(self) -> Collection[str]:
        """Reward flags that drop an episode."""

    @property
    def max_tokens(self) -> int:
        """Longest segment."""

    @property
    def too_long(self) -> str:
        """ "truncate" a longer segment at max_tokens, or "drop" its episode."""

    @property
    def min_episodes(self) -> int:
        """Fewest kept episodes a group needs to be trained on."""


@dataclass(slots=True)
class Built:
    """The outcome of building one group."""

    samples: pb.GroupSamples | None
    """None when the group is not trained on (see `dropped`)."""
    dropped: str | None = None
    """Why the whole group is not trained on: "val", "zero_variance", "too_few_episodes"."""
    rewards: list[float] = field(default_factory=list)
    """Rewards of the kept episodes (val groups: of every rewarded episode)."""
    episodes_dropped: list[pb.DroppedEpisode] = field(default_factory=list)
    merge: pb.MergeStats = field(default_factory=pb.MergeStats)
    truncated: int = 0
    books: pb.TokenBooks = field(default_factory=pb.TokenBooks)
    """Where the group's captured completion tokens went (also in `samples.books`)."""
    dropped_tokens: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class KeptEpisode:
    """An episode to be trained: its reward and its merged (maybe truncated) chains."""

    episode: GroupEpisode
    reward: float
    segments: list[Segment]


def published(built: Built, group_id: str, task_id: str, estimator: str) -> pb.GroupSamples:
    """What goes on hrl.samples for a built group: its samples, or, for a group that trains
    nothing, a record without samples naming why (`dropped_reason`) with its token books,
    so every captured token reaches the topic's books."""
    if built.samples is not None:
        return built.samples
    return pb.GroupSamples(
        group_id=group_id,
        task_id=task_id,
        merge=built.merge,
        dropped=built.episodes_dropped,
        estimator=estimator,
        books=built.books,
        dropped_reason=built.dropped or "dropped",
    )


def build(group: Group, settings: Rules, decode: Decode | None = None) -> Built:
    """The samples of `group` from what has arrived (all of it, unless timed out)."""
    built = Built(samples=None)
    kept: list[KeptEpisode] = []
    val = group.mode == pb.MODE_VAL
    for episode in group.episodes():
        reason, reward = verdict(episode, settings)
        if reason is None and val:
            built.rewards.append(reward)  # type: ignore[arg-type]  # not None when kept
            drop_episode(built, episode, "val")
            continue
        if reason is None:
            assert reward is not None
            reason = merge_episode(
                episode, reward, settings=settings, decode=decode, built=built, kept=kept
            )
        if reason is not None:
            drop_episode(built, episode, reason.partition(":")[0])
            built.episodes_dropped.append(
                pb.DroppedEpisode(
                    episode_id=episode.episode_id,
                    attempt=episode.attempt,
                    reason=reason,
                    calls=len(episode.state.calls),
                )
            )
    if val:  # evaluated, never trained on: only its rewards are reported
        return _dropped(built, kept, "val")
    built.rewards = [k.reward for k in kept]
    if len(kept) < settings.min_episodes:
        return _dropped(built, kept, "too_few_episodes")
    advantage = advantages(built.rewards, settings.estimator, eps=settings.eps)
    if advantage is None:
        return _dropped(built, kept, "zero_variance")
    close_books(built, kept, None)
    built.samples = samples = pb.GroupSamples(
        group_id=group.group_id,
        task_id=group.task_id,
        merge=built.merge,
        dropped=built.episodes_dropped,
        estimator=settings.estimator,
        books=built.books,
    )
    for k, value in zip(kept, advantage, strict=True):
        for index, segment in enumerate(k.segments):
            fill_sample(samples.samples.add(), k, index, segment, value)  # in place: no copies
    return built


def _dropped(built: Built, kept: list[KeptEpisode], reason: str) -> Built:
    """`built` for a group that is not trained on, for `reason`."""
    built.dropped = reason
    close_books(built, kept, reason)
    return built


def _drop_tokens(built: Built, calls: Sequence[pb.ModelCall], reason: str) -> None:
    """Count the completion tokens of `calls` (each distinct copy) captured and dropped."""
    tokens = sum(len(c.completion_token_ids) for c in calls)
    built.books.captured += tokens
    built.dropped_tokens[reason] += tokens


def drop_episode(built: Built, episode: GroupEpisode, reason: str) -> None:
    """All of an episode's captured tokens dropped for `reason`."""
    _drop_tokens(built, episode.every_call, reason)
    held = episode.overflow()[0] + episode.overflow(beyond=True)[0]
    built.books.captured += held
    built.dropped_tokens[reason] += held


def close_books(built: Built, kept: list[KeptEpisode], reason: str | None) -> None:
    """The kept episodes' tokens trained, or all dropped for the group's `reason`."""
    trained = sum(s.trained_tokens for k in kept for s in k.segments)
    if reason is None:
        built.books.trained = trained
    else:
        built.dropped_tokens[reason] += trained
    for name, tokens in sorted(built.dropped_tokens.items()):
        if tokens:
            built.books.dropped[name] = tokens


def verdict(episode: GroupEpisode, settings: Rules) -> tuple[str | None, float | None]:
    """(reason to drop, None) or (None, the reward to train with)."""
    state = episode.state
    waiting = state.missing()
    if waiting is not None:
        return f"incomplete:{waiting}", None
    assert state.finished is not None and state.reward is not None
    status = state.finished.status
    if status in (pb.EPISODE_STATUS_INVALID, pb.EPISODE_STATUS_UNSPECIFIED):
        return "invalid", None
    if status != pb.EPISODE_STATUS_SUCCEEDED and not settings.keep_failed:
        return pb.EpisodeStatus.Name(status).removeprefix("EPISODE_STATUS_").lower(), None
    for flag in state.reward.flags:
        if flag in settings.drop_flags:
            return f"flagged:{flag}", None
    if state.reward.missing:
        if settings.missing_reward == "drop":
            return "reward_missing", None
        return None, settings.fill_value
    return None, state.reward.value


def merge_episode(
    episode: GroupEpisode,
    reward: float,
    *,
    settings: Rules,
    decode: Decode | None,
    built: Built,
    kept: list[KeptEpisode],
) -> str | None:
    """Merge the episode's calls into `kept`; the reason to drop it instead, if any."""
    calls = [to_call(c) for c in episode.calls]
    if not calls:
        return "no_calls"
    try:
        merged = merge(calls, decode=decode)
    except ValueError as err:
        return f"bad_calls:{err}"[:200]
    segments = []
    cut = 0
    for whole in merged.segments:
        segment = whole
        if len(whole.token_ids) > settings.max_tokens:
            if settings.too_long == "drop":
                return "too_long"
            segment = truncate(whole, settings.max_tokens)
            cut += whole.trained_tokens - segment.trained_tokens
            built.truncated += 1
        segments.append(segment)
    _drop_tokens(built, episode.beyond, "beyond_call_count")
    beyond, _ = episode.overflow(beyond=True)
    conflicting, copies = episode.overflow()  # copies of a seq past MAX_COPIES, not held
    built.books.captured += merged.captured + beyond + conflicting
    built.dropped_tokens["beyond_call_count"] += beyond
    built.dropped_tokens[str(Dropped.SEQ_CONFLICT)] += conflicting
    built.merge.seq_conflicts += copies
    for reason, tokens in merged.dropped.items():
        built.dropped_tokens[str(reason)] += tokens
    built.dropped_tokens["truncated"] += cut
    _count(built.merge, episode.episode_id, merged, len(calls))
    kept.append(KeptEpisode(episode, reward, segments))
    return None


DETAILS = 16
"""Breaks described in a group's MergeStats (the first ones, in episode order)."""


def _count(stats: pb.MergeStats, episode_id: str, merged: MergeResult, calls: int) -> None:
    counts = merged.break_counts
    stats.calls += calls
    stats.segments += len(merged.segments)
    stats.break_chat_template += counts[BreakKind.CHAT_TEMPLATE]
    stats.break_retokenization += counts[BreakKind.RETOKENIZATION]
    stats.break_compaction += counts[BreakKind.COMPACTION]
    stats.break_side_chain += counts[BreakKind.SIDE_CHAIN]
    stats.break_other += counts[BreakKind.OTHER]
    stats.duplicates_replaced += merged.duplicates_replaced
    stats.seq_conflicts += merged.seq_conflicts
    stats.temperature_breaks += merged.temperature_breaks
    for b in merged.breaks[: max(0, DETAILS - len(stats.details))]:
        stats.details.add(
            episode_id=episode_id,
            seq=b.seq,
            kind=str(b.kind),
            nearest_seq=max(0, b.nearest_seq),
            position=b.position,
            recorded=b.recorded,
            sent=b.sent,
        )


def to_call(call: pb.ModelCall) -> Call:
    """The merging view of a recorded call."""
    return Call(
        seq=call.seq,
        prompt_ids=np.array(call.prompt_token_ids, dtype=np.uint32),
        completion_ids=np.array(call.completion_token_ids, dtype=np.uint32),
        logprobs=np.array(call.completion_logprobs, dtype=np.float32),
        policy_version=call.policy_version,
        temperature=call.temperature,
        span_id=call.span_id,
        constrained=bool(call.constrained),
        source=call,
    )


def fill_sample(
    sample: pb.Sample, kept: KeptEpisode, index: int, segment: Segment, advantage: float
) -> None:
    """Write chain `index` of a kept episode into `sample`, `advantage` on all its tokens."""
    episode = kept.episode
    sample.sample_id = f"{episode.episode_id}/{episode.attempt}/{index}"
    sample.episode_id = episode.episode_id
    sample.attempt = episode.attempt
    sample.segment_index = index
    last = segment.source
    if isinstance(last, pb.ModelCall) and not segment.truncated:
        # The sequence is its last call's prompt + completion: copied field to field inside
        # protobuf, ~100x faster than through a Python list.
        sample.token_ids.extend(last.prompt_token_ids)
        sample.token_ids.extend(last.completion_token_ids)
    else:
        sample.token_ids.extend(segment.token_ids.tolist())
    # Packed bools and floats are their little-endian bytes on the wire: merging them in as
    # bytes is ~50x faster than going through Python lists, and parses to the same message.
    sample.MergeFromString(
        _packed(_LOSS_MASK, segment.loss_mask.view(np.uint8).tobytes())
        + _packed(_LOGPROBS, segment.logprobs.astype("<f4", copy=False).tobytes())
    )
    sample.advantage = advantage
    sample.reward = kept.reward
    sample.policy_version_min = segment.policy_version_min
    sample.policy_version_max = segment.policy_version_max
    sample.truncated = segment.truncated
    sample.call_seqs.extend(segment.call_seqs)
    sample.temperature = segment.temperature
    sample.call_span_ids.extend(segment.span_ids)


_LOSS_MASK = pb.Sample.DESCRIPTOR.fields_by_name["loss_mask"].number
_LOGPROBS = pb.Sample.DESCRIPTOR.fields_by_name["behavior_logprobs"].number


def _packed(field: int, payload: bytes) -> bytes:
    """A packed repeated field on the wire: tag (length-delimited), length, payload."""
    if not payload:
        return b""
    return varint(field << 3 | 2) + varint(len(payload)) + payload
