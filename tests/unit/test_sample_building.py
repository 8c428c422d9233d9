"""Building a group's samples from its events, as they come off three topics: late, twice,
in any order, some episodes retried, some rewards missing or flagged.

`groups()` plays out whole groups and writes down, beside the protobuf events, what the
builder must make of them: the segments are recorded turn by turn as the conversation made
them (inserted ids mask 0, completions mask 1, a break starts over, a retried call replaces
the one before), and the verdict on each episode follows the settings' documented rules.
The test does not rerun the builder's algorithm; it checks the builder against that record.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from google.protobuf.message import Message
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from harnessrl.services.sample_builder.config import SampleBuilderSection
from harnessrl.trust.group import MAX_COPIES, Group
from harnessrl.trust.samples import Built, build
from harnessrl.v1 import events_pb2 as pb

PROPERTY = settings(max_examples=60, deadline=None)
RARELY = st.sampled_from([False] * 9 + [True])
SOMETIMES = st.sampled_from([False] * 4 + [True])
VOCAB = st.integers(0, 99)
"""Prompt and inserted ids of final attempts."""
UNIQUE = 1000
"""Completion ids and break markers of final attempts count up from here: one token each."""
RETRIED = 5_000_000
"""Every id of a retried (non-final) attempt is at least this: none may reach a sample."""
REQUIRED = ("model_call", "episode_closed", "episode_finished", "reward_assigned")
ORDER_UNKNOWN = 1 << 32
FAILED_REASON = {pb.EPISODE_STATUS_FAILED: "failed", pb.EPISODE_STATUS_TIMEOUT: "timeout"}


@dataclass(frozen=True, slots=True)
class Event:
    kind: str
    """The envelope's oneof name, as `Group.add` takes it."""
    message: Message
    episode: int
    """Index of the episode in the group."""
    final: bool
    """Of the episode's final attempt."""


@dataclass
class Segment:
    """A segment as the conversation built it: (inserted ids, call) per kept call."""

    pieces: list[tuple[list[int], pb.ModelCall]] = field(default_factory=list)

    @property
    def calls(self) -> list[pb.ModelCall]:
        return [call for _, call in self.pieces]

    def arrays(self) -> tuple[list[int], list[bool], list[float]]:
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        for inserted, call in self.pieces:
            ids += [*inserted, *call.completion_token_ids]
            mask += [False] * len(inserted) + [True] * len(call.completion_token_ids)
            logprobs += [0.0] * len(inserted) + list(call.completion_logprobs)
        return ids, mask, logprobs


@dataclass
class Episode:
    episode_id: str
    index: int
    attempt: int
    """The final attempt."""
    status: int
    reward: pb.RewardAssigned
    calls: list[pb.ModelCall]
    """Calls of the final attempt, in seq order, replaced retries included."""
    segments: list[Segment]
    replaced: list[pb.ModelCall]
    """Calls the next call retried (same prompt): never trained on."""
    breaks: int


@dataclass
class Case:
    group_id: str
    task_id: str
    val: bool
    episodes: list[Episode]
    events: list[Event]

    def indices(self, episode: int, kinds: Iterable[str]) -> list[int]:
        """Indices of the events of these kinds of the episode's final attempt."""
        kinds = set(kinds)
        return [
            i
            for i, e in enumerate(self.events)
            if e.episode == episode and e.kind in kinds and e.final
        ]

    @property
    def required(self) -> set[int]:
        return {i for i, e in enumerate(self.events) if e.final and e.kind in REQUIRED}

    @property
    def started(self) -> set[int]:
        return {i for i, e in enumerate(self.events) if e.kind == "episode_started"}


def _hex(draw: st.DrawFn, size: int) -> str:
    return draw(st.binary(min_size=size, max_size=size)).hex()


class _Episode:
    """Draws the events of one episode of a group."""

    def __init__(self, draw: st.DrawFn, group: Case, index: int, size: int) -> None:
        self.draw, self.group, self.index, self.size = draw, group, index, size
        self.episode_id = f"{group.group_id}-{index}"
        self.mode = pb.MODE_VAL if group.val else pb.MODE_TRAIN
        self.temperature = draw(st.sampled_from([0.6, 1.0]))

    def call(
        self, attempt: int, seq: int, prompt: list[int], completion: list[int]
    ) -> pb.ModelCall:
        draw = self.draw
        n = len(completion)
        return pb.ModelCall(
            episode_id=self.episode_id,
            attempt=attempt,
            group_id=self.group.group_id,
            seq=seq,
            mode=self.mode,
            api=pb.API_OPENAI_CHAT,
            model="policy",
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=draw(st.lists(st.floats(-20, 0, width=32), min_size=n, max_size=n)),
            policy_version=draw(st.integers(0, 3)),
            finish_reason="stop",
            trace_id=_hex(draw, 16),
            span_id=_hex(draw, 8),
            temperature=self.temperature,
        )

    def retried_calls(self, attempt: int) -> list[pb.ModelCall]:
        draw, calls = self.draw, []
        prompt = [RETRIED + t for t in draw(st.lists(VOCAB, min_size=1, max_size=4))]
        for seq in range(draw(st.integers(0, 3))):
            completion = [RETRIED + t for t in draw(st.lists(VOCAB, min_size=1, max_size=4))]
            calls.append(self.call(attempt, seq, prompt, completion))
            prompt = [*prompt, *completion, RETRIED + draw(VOCAB)]
        return calls

    def final(self, attempt: int, unique: Iterable[int], reward: pb.RewardAssigned) -> Episode:
        """The final attempt: 1-6 calls (rarely none) that mostly extend the context; some
        break it (a context starting with a fresh marker id), some retry the call before
        (same prompt)."""
        draw, fresh = self.draw, iter(unique)
        calls: list[pb.ModelCall] = []
        segments: list[Segment] = []
        replaced: list[pb.ModelCall] = []
        breaks = 0
        count = 0 if draw(RARELY) else draw(st.integers(1, 6))
        for seq in range(count):
            completion = [next(fresh) for _ in range(draw(st.integers(1, 5)))]
            action = (
                "start" if seq == 0 else draw(st.sampled_from(["extend"] * 5 + ["break", "retry"]))
            )
            if action == "start":
                prompt = inserted = draw(st.lists(VOCAB, min_size=1, max_size=6))
            elif action == "extend":
                inserted = draw(st.lists(VOCAB, max_size=4))
                prompt = [*calls[-1].prompt_token_ids, *calls[-1].completion_token_ids, *inserted]
            elif action == "retry":
                prompt, inserted = list(calls[-1].prompt_token_ids), segments[-1].pieces[-1][0]
            else:  # a context of its own (where breaks fall is test_merging.py's business)
                prompt = inserted = [next(fresh), *draw(st.lists(VOCAB, max_size=4))]
            call = self.call(attempt, seq, prompt, completion)
            calls.append(call)
            if action in ("start", "break"):
                segments.append(Segment([(inserted, call)]))
                breaks += action == "break"
            elif action == "extend":
                segments[-1].pieces.append((inserted, call))
            else:
                replaced.append(segments[-1].pieces[-1][1])
                segments[-1].pieces[-1] = (inserted, call)
        for segment in segments:  # the record agrees with what the engine saw
            last = segment.calls[-1]
            assert segment.arrays()[0] == [*last.prompt_token_ids, *last.completion_token_ids]
        return Episode(
            episode_id=self.episode_id,
            index=self.index,
            attempt=attempt,
            status=self.draw(st.sampled_from(STATUSES)),
            reward=reward,
            calls=calls,
            segments=segments,
            replaced=replaced,
            breaks=breaks,
        )

    def reward(self, attempt: int, value: float | None) -> pb.RewardAssigned:
        draw = self.draw
        missing = value is None and draw(SOMETIMES)
        if value is None:
            value = draw(st.sampled_from([0.0, 0.5, 1.0]) | st.floats(-1, 1))
        if missing:  # the value means nothing then, and may be anything
            value = draw(st.sampled_from([math.nan, value]))
        flags = draw(st.sampled_from([*[[]] * 6, ["tests_modified"], ["empty_patch"], FLAGS]))
        return pb.RewardAssigned(
            episode_id=self.episode_id,
            attempt=attempt,
            group_id=self.group.group_id,
            value=value,
            flags=flags,
            source="builtin:test",
            missing=missing,
        )

    def attempt_events(
        self,
        attempt: int,
        *,
        final: bool,
        status: int,
        calls: list[pb.ModelCall],
        reward: pb.RewardAssigned,
    ) -> list[Event]:
        ids = {"episode_id": self.episode_id, "attempt": attempt, "group_id": self.group.group_id}
        task = {"task_id": self.group.task_id, "mode": self.mode}
        messages: list[tuple[str, Message]] = [
            (
                "episode_started",
                pb.EpisodeStarted(
                    **ids,
                    **task,
                    index=self.index,
                    group_size=self.size,
                    trace_id=_hex(self.draw, 16),
                ),
            ),
            *(("model_call", c) for c in calls),
            ("episode_closed", pb.EpisodeClosed(**ids, call_count=len(calls), reason="finished")),
            ("episode_finished", pb.EpisodeFinished(**ids, **task, status=status, final=final)),
            ("reward_assigned", reward),
        ]
        return [Event(kind, message, self.index, final) for kind, message in messages]


FLAGS = ["empty_patch", "tests_modified"]
STATUSES = [pb.EPISODE_STATUS_SUCCEEDED] * 8 + [
    pb.EPISODE_STATUS_FAILED,
    pb.EPISODE_STATUS_TIMEOUT,
    pb.EPISODE_STATUS_INVALID,
]


@st.composite
def groups(draw: st.DrawFn, *, val: bool | None = None, reward: float | None = None) -> Case:
    """A whole group of 2-6 episodes; about one in four retried once. `reward` fixes every
    final attempt's reward (none missing)."""
    group_id = f"g{draw(st.integers(0, 99))}"
    val = draw(st.integers(0, 4)) == 0 if val is None else val
    case = Case(group_id, f"task-{group_id}", val, [], [])
    size = draw(st.integers(2, 6))
    unique = itertools.count(UNIQUE)
    for index in range(size):
        maker = _Episode(draw, case, index, size)
        final = 2 if draw(st.integers(0, 3)) == 0 else 1
        for attempt in range(1, final):
            status = draw(st.sampled_from([pb.EPISODE_STATUS_FAILED, pb.EPISODE_STATUS_TIMEOUT]))
            case.events += maker.attempt_events(
                attempt,
                final=False,
                status=status,
                calls=maker.retried_calls(attempt),
                reward=maker.reward(attempt, None),
            )
        episode = maker.final(final, unique, maker.reward(final, reward))
        case.episodes.append(episode)
        case.events += maker.attempt_events(
            final, final=True, status=episode.status, calls=episode.calls, reward=episode.reward
        )
    return case


@st.composite
def sections(draw: st.DrawFn, **fixed: object) -> SampleBuilderSection:
    values: dict[str, object] = {
        "estimator": draw(st.sampled_from(["grpo", "rloo", "mean"])),
        "eps": draw(st.sampled_from([1e-6, 1e-3])),
        "keep_failed": draw(st.booleans()),
        "missing_reward": draw(st.sampled_from(["drop", "fill"])),
        "fill_value": draw(st.sampled_from([0.0, 0.25, -1.0])),
        "drop_flags": draw(
            st.sampled_from([["tests_modified"], [], ["empty_patch", "tests_modified"]])
        ),
        "max_tokens": draw(st.sampled_from([32768, 32768, 16, 24, 40])),
        "too_long": draw(st.sampled_from(["truncate", "drop"])),
        "min_episodes": draw(st.sampled_from([2, 2, 2, 3])),
    }
    return SampleBuilderSection(**{**values, **fixed})


def stream(case: Case, rng: random.Random, keep: Iterable[int] | None = None) -> list[int]:
    """Event indices in a random order, some delivered more than once."""
    order = list(range(len(case.events)) if keep is None else keep)
    order += rng.choices(order, k=rng.randint(0, len(order))) if order else []
    rng.shuffle(order)
    return order


def feed(case: Case, order: Iterable[int]) -> Group:
    group = Group(case.group_id, first_seen=0.0)
    for i in order:
        group.add(case.events[i].kind, case.events[i].message)
    return group


def expected_advantages(rewards: Sequence[float], estimator: str, eps: float) -> list[float]:
    n = len(rewards)
    mean = math.fsum(rewards) / n
    if estimator == "grpo":
        std = math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / n)
        return [(r - mean) / (std + eps) for r in rewards]
    if estimator == "rloo":
        return [r - (math.fsum(rewards) - r) / (n - 1) for r in rewards]
    return [r - mean for r in rewards]


# --- the expected outcome ---------------------------------------------------------------------


def waiting_for(case: Case, episode: Episode, present: set[int]) -> str | None:
    """What the final attempt still lacks of what arrived, as the builder names it."""
    for what, kinds in (
        ("finished", ["episode_finished"]),
        ("closed", ["episode_closed"]),
        ("calls", ["model_call"]),
        ("reward", ["reward_assigned"]),
    ):
        if not set(case.indices(episode.index, kinds)) <= present:
            return what
    return None


def verdict(
    case: Case, episode: Episode, s: SampleBuilderSection, present: set[int]
) -> tuple[str | None, float]:
    """(reason to drop, reward) by the documented rules, before any merging."""
    waiting = waiting_for(case, episode, present)
    reward = episode.reward
    if waiting is not None:
        return f"incomplete:{waiting}", math.nan
    if episode.status == pb.EPISODE_STATUS_INVALID:
        return "invalid", math.nan
    if episode.status != pb.EPISODE_STATUS_SUCCEEDED and not s.keep_failed:
        return FAILED_REASON[episode.status], math.nan
    for flag in reward.flags:
        if flag in s.drop_flags:
            return f"flagged:{flag}", math.nan
    if reward.missing:
        return ("reward_missing", math.nan) if s.missing_reward == "drop" else (None, s.fill_value)
    return None, reward.value


def too_long(segment: Segment, s: SampleBuilderSection) -> bool:
    return len(segment.arrays()[0]) > s.max_tokens


def check(
    case: Case, s: SampleBuilderSection, built: Built, present: set[int] | None = None
) -> None:
    """Everything the builder must have made of the events in `present` (default: all)."""
    present = set(range(len(case.events))) if present is None else present
    known = {case.events[i].episode for i in present & case.started}
    listed = sorted(
        (e for e in case.episodes if set(case.indices(e.index, ["episode_finished"])) <= present),
        key=lambda e: (e.index if e.index in known else ORDER_UNKNOWN, e.episode_id),
    )
    val = case.val and any(
        case.events[i].kind in ("episode_started", "episode_finished") for i in present
    )
    dropped: list[tuple[str, int, str, int]] = []
    kept: list[tuple[Episode, float]] = []
    val_rewards: list[float] = []
    for episode in listed:
        reason, reward = verdict(case, episode, s, present)
        if reason is None and val:
            val_rewards.append(reward)
            continue
        if reason is None and not episode.calls:
            reason = "no_calls"
        if (
            reason is None
            and s.too_long == "drop"
            and any(too_long(g, s) for g in episode.segments)
        ):
            reason = "too_long"
        if reason is None:
            kept.append((episode, reward))
        else:
            arrived = len(set(case.indices(episode.index, ["model_call"])) & present)
            dropped.append((episode.episode_id, episode.attempt, reason, arrived))
    assert [(d.episode_id, d.attempt, d.reason, d.calls) for d in built.episodes_dropped] == dropped
    check_books(case, built, listed, present)
    if val:
        assert (built.samples, built.dropped, built.rewards) == (None, "val", val_rewards)
        assert built.merge == pb.MergeStats()
        return
    rewards = [r for _, r in kept]
    assert built.rewards == rewards
    segments = [g for e, _ in kept for g in e.segments]
    stats = built.merge
    assert stats.calls == sum(len(e.calls) for e, _ in kept)
    assert stats.segments == len(segments)
    assert stats.duplicates_replaced == sum(len(e.replaced) for e, _ in kept)
    assert stats.break_chat_template + stats.break_other + stats.break_compaction + (
        stats.break_side_chain
    ) == sum(e.breaks for e, _ in kept)
    assert stats.break_retokenization == 0  # no decoder given
    assert built.truncated == sum(too_long(g, s) for g in segments)
    if len(kept) < s.min_episodes:
        assert (built.samples, built.dropped) == (None, "too_few_episodes")
    elif len(set(rewards)) == 1:
        assert (built.samples, built.dropped) == (None, "zero_variance")
    else:
        assert built.dropped is None and built.samples is not None
        check_samples(case, s, built, kept)


def check_books(case: Case, built: Built, listed: list[Episode], present: set[int]) -> None:
    """Every completion token of the final attempts' calls that arrived is trained (mask 1
    in a sample) or dropped with a reason, once."""
    arrived = {i for e in listed for i in case.indices(e.index, ["model_call"]) if i in present}
    books = built.books
    assert books.captured == sum(
        len(case.events[i].message.completion_token_ids)  # type: ignore[attr-defined]
        for i in arrived
    )
    assert books.captured == books.trained + sum(books.dropped.values())
    assert all(tokens > 0 for tokens in books.dropped.values())
    if built.samples is None:  # nothing of the group is trained on
        assert books.trained == 0
        return
    assert built.samples.books == books
    assert books.trained == sum(sum(sample.loss_mask) for sample in built.samples.samples)


def check_samples(
    case: Case, s: SampleBuilderSection, built: Built, kept: list[tuple[Episode, float]]
) -> None:
    out = built.samples
    assert out is not None
    assert (out.group_id, out.task_id, out.estimator) == (case.group_id, case.task_id, s.estimator)
    assert out.merge == built.merge and list(out.dropped) == built.episodes_dropped
    assert out.merge.segments == len(out.samples)
    advantage = expected_advantages([r for _, r in kept], s.estimator, s.eps)
    samples = iter(out.samples)
    for (episode, reward), value in zip(kept, advantage, strict=True):
        mine = [next(samples) for _ in episode.segments]
        assert len({m.advantage for m in mine}) == 1  # one advantage per episode
        assert math.isclose(mine[0].advantage, value, rel_tol=1e-6, abs_tol=1e-6)
        for index, (sample, segment) in enumerate(zip(mine, episode.segments, strict=True)):
            check_sample(sample, episode, index, segment, s)
            assert sample.reward == reward
        if not any(m.truncated for m in mine):
            check_trained_once(mine, episode)
    assert next(samples, None) is None


def check_sample(
    sample: pb.Sample, episode: Episode, index: int, segment: Segment, s: SampleBuilderSection
) -> None:
    ids, mask, logprobs = segment.arrays()
    calls = segment.calls
    assert sample.sample_id == f"{episode.episode_id}/{episode.attempt}/{index}"
    assert (sample.episode_id, sample.attempt, sample.segment_index) == (
        episode.episode_id,
        episode.attempt,
        index,
    )
    # The last merged call's prompt + completion, exactly as the engine saw them.
    whole = [*calls[-1].prompt_token_ids, *calls[-1].completion_token_ids]
    assert ids == whole
    assert sample.truncated == (len(whole) > s.max_tokens)
    assert list(sample.token_ids) == whole[: s.max_tokens]
    assert list(sample.loss_mask) == mask[: s.max_tokens]
    assert list(sample.behavior_logprobs) == logprobs[: s.max_tokens]
    assert all(
        lp == 0.0 for lp, m in zip(sample.behavior_logprobs, sample.loss_mask, strict=True) if not m
    )
    assert max(sample.token_ids) < RETRIED  # nothing of a retried attempt
    assert list(sample.call_seqs) == [c.seq for c in calls]
    assert list(sample.call_span_ids) == [c.span_id for c in calls]
    versions = [c.policy_version for c in calls]
    assert (sample.policy_version_min, sample.policy_version_max) == (min(versions), max(versions))
    assert sample.temperature == calls[0].temperature


def check_trained_once(samples: list[pb.Sample], episode: Episode) -> None:
    """Every completion token of every kept call is trained on exactly once, with its own
    log-prob; nothing else is (completion ids are unique within the group)."""
    trained = Counter(
        (token, lp)
        for s in samples
        for token, m, lp in zip(s.token_ids, s.loss_mask, s.behavior_logprobs, strict=True)
        if m
    )
    replaced = {id(c) for c in episode.replaced}
    kept_calls = [c for c in episode.calls if id(c) not in replaced]
    completions = Counter(
        pair
        for c in kept_calls
        for pair in zip(c.completion_token_ids, c.completion_logprobs, strict=True)
    )
    assert trained == completions
    assert set(trained.values()) <= {1}
    assert not {t for c in episode.replaced for t in c.completion_token_ids} & {
        t for t, _ in trained
    }


# --- the tests --------------------------------------------------------------------------------


@given(groups(), st.randoms(use_true_random=False))
@PROPERTY
def test_group_is_ready_exactly_when_every_required_event_has_arrived(
    case: Case, rng: random.Random
) -> None:
    order = stream(case, rng)
    group = Group(case.group_id, first_seen=0.0)
    seen: set[int] = set()
    for i in order:
        group.add(case.events[i].kind, case.events[i].message)
        seen.add(i)
        assert group.ready == (case.required <= seen and bool(seen & case.started)), i
    assert group.ready
    for gone in case.required:
        partial = feed(case, [i for i in order if i != gone])
        assert not partial.ready, case.events[gone]


@given(groups(), sections(), st.randoms(use_true_random=False))
@PROPERTY
def test_samples_follow_the_recorded_calls_and_the_group_rewards(
    case: Case, s: SampleBuilderSection, rng: random.Random
) -> None:
    check(case, s, build(feed(case, stream(case, rng)), s))


@given(groups(), sections(), st.randoms(use_true_random=False))
@PROPERTY
def test_samples_are_the_same_bytes_whatever_the_arrival_order_and_redelivery(
    case: Case, s: SampleBuilderSection, rng: random.Random
) -> None:
    first = build(feed(case, range(len(case.events))), s)
    again = build(feed(case, stream(case, rng)), s)
    if first.samples is None:
        assert again.samples is None
    else:
        assert again.samples is not None
        assert first.samples.SerializeToString(
            deterministic=True
        ) == again.samples.SerializeToString(deterministic=True)
    assert (first.dropped, first.rewards, first.episodes_dropped, first.merge, first.truncated) == (
        again.dropped,
        again.rewards,
        again.episodes_dropped,
        again.merge,
        again.truncated,
    )


@given(groups(val=False), sections(max_tokens=16), st.randoms(use_true_random=False))
@PROPERTY
def test_long_segments_are_cut_or_their_episode_dropped(
    case: Case, s: SampleBuilderSection, rng: random.Random
) -> None:
    built = build(feed(case, stream(case, rng)), s)
    check(case, s, built)
    samples = [] if built.samples is None else list(built.samples.samples)
    assert all(len(sample.token_ids) <= s.max_tokens for sample in samples)
    if s.too_long == "drop":
        assert built.truncated == 0 and not any(sample.truncated for sample in samples)
    else:
        assert all(len(sample.token_ids) == s.max_tokens for sample in samples if sample.truncated)
        assert "too_long" not in {d.reason for d in built.episodes_dropped}


@given(groups(val=False, reward=0.5), sections(), st.randoms(use_true_random=False))
@PROPERTY
def test_groups_without_reward_variance_are_never_trained_on(
    case: Case, s: SampleBuilderSection, rng: random.Random
) -> None:
    s = s.model_copy(update={"fill_value": 0.5})
    built = build(feed(case, stream(case, rng)), s)
    check(case, s, built)
    assert built.samples is None
    assert built.dropped in ("zero_variance", "too_few_episodes")
    assume(built.dropped == "zero_variance")


@given(groups(val=True), sections(), st.randoms(use_true_random=False))
@PROPERTY
def test_val_groups_are_never_trained_on(
    case: Case, s: SampleBuilderSection, rng: random.Random
) -> None:
    built = build(feed(case, stream(case, rng)), s)
    check(case, s, built)
    assert (built.samples, built.dropped) == (None, "val")


@given(groups(val=False), sections(), st.randoms(use_true_random=False))
@PROPERTY
def test_groups_with_too_few_kept_episodes_are_never_trained_on(
    case: Case, s: SampleBuilderSection, rng: random.Random
) -> None:
    s = s.model_copy(update={"min_episodes": len(case.episodes) + 1})
    built = build(feed(case, stream(case, rng)), s)
    check(case, s, built)
    assert (built.samples, built.dropped) == (None, "too_few_episodes")


@given(groups(), sections(), st.randoms(use_true_random=False), st.data())
@PROPERTY
def test_a_timed_out_group_keeps_only_its_complete_episodes(
    case: Case, s: SampleBuilderSection, rng: random.Random, data: st.DataObject
) -> None:
    everything = set(range(len(case.events)))
    some = data.draw(st.sets(st.sampled_from(sorted(everything))))
    present = some if data.draw(st.booleans()) else everything - some  # sparse or nearly whole
    group = feed(case, stream(case, rng, sorted(present)))
    built = build(group, s)
    check(case, s, built, present)
    assert all(
        d.reason in {"incomplete:closed", "incomplete:calls", "incomplete:reward"}
        for d in built.episodes_dropped
        if d.reason.startswith("incomplete:")
    )


@given(groups(), sections(), st.randoms(use_true_random=False))
@settings(max_examples=25, deadline=None)
def test_a_group_missing_any_one_required_event_drops_that_episode_as_incomplete(
    case: Case, s: SampleBuilderSection, rng: random.Random
) -> None:
    order = stream(case, rng)
    for gone in case.required:
        present = set(range(len(case.events))) - {gone}
        built = build(feed(case, [i for i in order if i != gone]), s)
        check(case, s, built, present)
        episode_id = f"{case.group_id}-{case.events[gone].episode}"
        reasons = {d.episode_id: d.reason for d in built.episodes_dropped}
        if case.events[gone].kind == "episode_finished":
            assert episode_id not in reasons  # its final attempt is not known at all
        else:
            assert reasons[episode_id].startswith("incomplete:")


# --- a few groups by hand ---------------------------------------------------------------------

OK = pb.EPISODE_STATUS_SUCCEEDED


def add_episode(
    group: Group,
    index: int,
    size: int,
    *,
    status: int = OK,
    value: float = 0.0,
    missing: bool = False,
    flags: Sequence[str] = (),
    mode: int = pb.MODE_TRAIN,
    calls: Sequence[dict[str, object]] | None = None,
    call_count: int | None = None,
) -> None:
    """Every event of a one-attempt episode; by default one call: [1, 2] -> [10 + index]."""
    ids = {"episode_id": f"g-{index}", "attempt": 1, "group_id": "g"}
    if calls is None:
        calls = [{"prompt_token_ids": [1, 2], "completion_token_ids": [10 + index]}]
    group.add("episode_started", pb.EpisodeStarted(**ids, index=index, group_size=size, mode=mode))
    for seq, fields in enumerate(calls):
        call = {"seq": seq, "completion_logprobs": [-0.5], "temperature": 1.0, **fields}
        group.add("model_call", pb.ModelCall(**ids, **call))
    count = len(calls) if call_count is None else call_count
    group.add("episode_closed", pb.EpisodeClosed(**ids, call_count=count))
    finished = pb.EpisodeFinished(**ids, status=status, final=True, mode=mode)
    group.add("episode_finished", finished)
    reward = pb.RewardAssigned(**ids, value=value, missing=missing, flags=flags)
    group.add("reward_assigned", reward)


def hand_group(*episodes: tuple[int, float, bool, list[str]], val: bool = False) -> Group:
    """Episodes of one call each: (status, reward value, reward missing, flags)."""
    group = Group("g", first_seen=0.0)
    mode = pb.MODE_VAL if val else pb.MODE_TRAIN
    for index, (status, value, missing, flags) in enumerate(episodes):
        add_episode(
            group,
            index,
            len(episodes),
            status=status,
            value=value,
            missing=missing,
            flags=flags,
            mode=mode,
        )
    assert group.ready
    return group


def test_missing_reward_is_filled_or_dropped_as_configured() -> None:
    group = hand_group((OK, 1.0, False, []), (OK, math.nan, True, []), (OK, 0.0, False, []))
    settings = SampleBuilderSection(missing_reward="fill", fill_value=0.5, estimator="mean")
    filled = build(group, settings)
    assert filled.rewards == [1.0, 0.5, 0.0]
    assert filled.samples is not None
    assert [s.advantage for s in filled.samples.samples] == [0.5, 0.0, -0.5]
    dropped = build(group, SampleBuilderSection(missing_reward="drop", estimator="rloo"))
    assert dropped.rewards == [1.0, 0.0]
    assert [(d.episode_id, d.reason) for d in dropped.episodes_dropped] == [
        ("g-1", "reward_missing")
    ]
    assert dropped.samples is not None
    assert [(s.episode_id, s.advantage) for s in dropped.samples.samples] == [
        ("g-0", 1.0),
        ("g-2", -1.0),
    ]


def test_invalid_failed_and_flagged_episodes_are_dropped_with_their_reason() -> None:
    group = hand_group(
        (OK, 1.0, False, []),
        (pb.EPISODE_STATUS_INVALID, 1.0, False, []),
        (pb.EPISODE_STATUS_FAILED, 0.0, False, []),
        (OK, 0.0, False, ["tests_modified"]),
        (OK, 0.5, False, ["empty_patch"]),
    )
    strict = build(group, SampleBuilderSection(keep_failed=False))
    assert [(d.episode_id, d.reason, d.calls) for d in strict.episodes_dropped] == [
        ("g-1", "invalid", 1),
        ("g-2", "failed", 1),
        ("g-3", "flagged:tests_modified", 1),
    ]
    assert strict.rewards == [1.0, 0.5]
    lenient = build(group, SampleBuilderSection(keep_failed=True))
    assert [d.reason for d in lenient.episodes_dropped] == ["invalid", "flagged:tests_modified"]
    assert lenient.rewards == [1.0, 0.0, 0.5]
    assert lenient.samples is not None
    assert [s.episode_id for s in lenient.samples.samples] == ["g-0", "g-2", "g-4"]


def test_a_val_group_reports_its_rewards_and_trains_nothing() -> None:
    group = hand_group((OK, 1.0, False, []), (OK, 0.0, False, []), val=True)
    built = build(group, SampleBuilderSection())
    assert (built.samples, built.dropped, built.rewards) == (None, "val", [1.0, 0.0])


def test_a_call_whose_logprobs_do_not_match_its_completion_drops_its_episode() -> None:
    group = Group("g", first_seen=0.0)
    for index in range(3):
        add_episode(group, index, 4, value=float(index))
    add_episode(group, 3, 4, calls=[{"prompt_token_ids": [1], "completion_token_ids": [7, 8]}])
    built = build(group, SampleBuilderSection())
    [dropped] = built.episodes_dropped
    assert (dropped.episode_id, dropped.calls) == ("g-3", 1)
    assert dropped.reason.startswith("bad_calls:") and "seq 0" in dropped.reason
    assert built.samples is not None and len(built.samples.samples) == 3


def test_a_call_beyond_call_count_does_not_stand_in_for_a_missing_one() -> None:
    group = Group("g", first_seen=0.0)
    add_episode(group, 0, 2, value=1.0)
    stray = {"seq": 2, "prompt_token_ids": [3], "completion_token_ids": [4]}
    first = {"prompt_token_ids": [1], "completion_token_ids": [2]}
    add_episode(group, 1, 2, calls=[first, stray], call_count=2)  # seq 1 never arrives
    assert not group.ready
    assert list(group.missing()) == ["g-1:calls"]


def test_copies_of_a_seq_past_the_cap_are_counted_not_held() -> None:
    """A sender that repeats seq 0 with ever new contents: MAX_COPIES conflicting copies are
    held for the merge, the rest only as a digest and a token count; redelivering any copy
    changes nothing, and every token is still in the books (one copy trained, the others
    dropped as seq_conflict)."""
    group = Group("g", first_seen=0.0)
    add_episode(group, 0, 2, value=1.0)
    add_episode(group, 1, 2, value=0.0)
    ids = {"episode_id": "g-1", "attempt": 1, "group_id": "g", "seq": 0, "temperature": 1.0}
    copies = [
        pb.ModelCall(
            **ids,
            prompt_token_ids=[1, 2],
            completion_token_ids=[20 + i, 5],
            completion_logprobs=[-0.5, -0.5],
        )
        for i in range(MAX_COPIES + 6)
    ]
    for call in copies + copies[::-1]:  # each twice, in both orders
        group.add("model_call", call)
    (attempt,) = (a for key, a in group._attempts.items() if key[0] == "g-1")
    assert len(attempt.conflicts[0]) == MAX_COPIES
    assert len(attempt.overflow[0]) == 6
    built = build(group, SampleBuilderSection())
    distinct = 1 + len(copies)  # the first copy add_episode sent, and these
    assert built.merge.seq_conflicts == distinct - 1
    books = built.books
    assert built.samples is not None
    (mine,) = (s for s in built.samples.samples if s.episode_id == "g-1")
    held = 1 + 2 * len(copies)  # g-1's tokens: add_episode's one-token copy, then these
    assert books.captured == 1 + held
    assert books.trained == 1 + sum(mine.loss_mask)
    assert dict(books.dropped) == {"seq_conflict": held - sum(mine.loss_mask)}
