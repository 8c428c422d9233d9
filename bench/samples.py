"""`harnessrl bench samples`: the sample builder against plain numpy, same groups, same run.

Synthetic groups (8 episodes x 8 calls by default) grow like agent conversations: a first
prompt of 1,000-2,000 ids, then each call's prompt is the previous prompt + completion +
50-300 inserted tool-output ids; completions are 100-500 ids with float32 log-probs. Each
group is a list of real serialised envelopes (EpisodeStarted, ModelCalls, EpisodeClosed,
EpisodeFinished, RewardAssigned per episode), seeded.

- builder: what the service pays per group except Kafka, bytes in -> bytes out: decode
  every record, feed it to `Group` (checking `ready` after each, as the service does),
  `build`, and encode the GroupSamples;
- concat: the same ids and log-probs already as numpy arrays, one `np.concatenate` of the
  calls' prompt + completion ids (and one of log-probs) per episode: the least work of
  producing one sequence per episode.

Both count the same tokens (the token ids of the samples the builder emits: one segment per
episode, its last call's prompt + completion), so `ratio` is builder / concat throughput.
Runs alternate builder, concat for --rounds rounds; medians are reported.

Then `shapes`: for the episode shapes real harnesses produce (a linear tool loop, thinking
over several user turns, a sub-agent interleaved with the main loop, a compaction, 128
side calls around a main loop; bench/sample_shapes.py), the builder's sequence tokens over
the least those chains need, and the calls per second it joins and builds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from harnessrl import events
from harnessrl.v1 import events_pb2 as pb

PHASES = ("decode", "join", "build", "encode")
VOCAB = 151_000


@dataclass(frozen=True, slots=True)
class CallArrays:
    """One call's ids and log-probs, as the baseline gets them."""

    prompt: npt.NDArray[np.uint32]
    completion: npt.NDArray[np.uint32]
    logprobs: npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class SyntheticGroup:
    group_id: str
    records: list[tuple[str, bytes]]
    """(topic, serialised envelope), in the order the service would see them."""
    episodes: list[list[CallArrays]]
    sample_tokens: int
    """Token ids of the samples the builder must emit (last prompt + completion per episode)."""


@dataclass(slots=True)
class Phases:
    """Seconds spent in each phase of the builder path, summed over groups."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


def conversation(rng: np.random.Generator, calls: int) -> list[CallArrays]:
    """One episode's calls: each prompt extends the previous prompt + completion."""
    out: list[CallArrays] = []
    prompt = _ids(rng, int(rng.integers(1000, 2001)))
    for _ in range(calls):
        n = int(rng.integers(100, 501))
        logprobs = (-rng.exponential(0.5, n)).astype(np.float32)
        out.append(CallArrays(prompt, _ids(rng, n), logprobs))
        inserted = _ids(rng, int(rng.integers(50, 301)))
        prompt = np.concatenate((prompt, out[-1].completion, inserted))
    return out


def synthetic_group(
    rng: np.random.Generator,
    group_id: str,
    episodes: int,
    calls: int,
    shape: Callable[[np.random.Generator], list[CallArrays]] | None = None,
) -> SyntheticGroup:
    """A complete, ready group of `episodes` episodes with `calls` calls each (or, given a
    `shape`, the calls it plays)."""
    records: list[tuple[str, bytes]] = []
    arrays: list[list[CallArrays]] = []

    def emit(event: Any) -> None:
        records.append((events.topic_of(event), events.encode(event, producer="bench")))

    for index in range(episodes):
        episode_id = f"{group_id}-e{index}"
        emit(
            pb.EpisodeStarted(
                episode_id=episode_id,
                attempt=1,
                group_id=group_id,
                group_size=episodes,
                index=index,
                mode=pb.MODE_TRAIN,
            )
        )
        arrays.append(conversation(rng, calls) if shape is None else shape(rng))
        trace_id = rng.bytes(16).hex()
        for seq, call in enumerate(arrays[-1]):
            emit(
                _model_call(
                    episode_id, group_id, seq, call, trace_id=trace_id, span_id=rng.bytes(8).hex()
                )
            )
        emit(
            pb.EpisodeClosed(
                episode_id=episode_id,
                attempt=1,
                group_id=group_id,
                call_count=len(arrays[-1]),
            )
        )
        emit(
            pb.EpisodeFinished(
                episode_id=episode_id,
                attempt=1,
                group_id=group_id,
                final=True,
                status=pb.EPISODE_STATUS_SUCCEEDED,
            )
        )
        reward = index / episodes  # distinct: the group's reward variance is > 0
        emit(pb.RewardAssigned(episode_id=episode_id, attempt=1, group_id=group_id, value=reward))
    sample_tokens = sum(len(e[-1].prompt) + len(e[-1].completion) for e in arrays)
    return SyntheticGroup(group_id, records, arrays, sample_tokens)


def builder_round(groups: list[SyntheticGroup], phases: Phases) -> tuple[float, int]:
    """(seconds, sample token ids emitted) of building every group from its bytes."""
    from harnessrl.services.sample_builder.config import SampleBuilderSection
    from harnessrl.trust.group import Group
    from harnessrl.trust.samples import build

    settings = SampleBuilderSection()
    seconds = phases.seconds
    total, tokens = 0.0, 0
    for synthetic in groups:
        t0 = time.perf_counter()
        decoded = [events.unwrap(events.decode(t, value))[1:] for t, value in synthetic.records]
        t1 = time.perf_counter()
        group = Group(synthetic.group_id, t1)
        ready = False
        for kind, event in decoded:
            group.add(kind, event)
            ready = group.ready
        t2 = time.perf_counter()
        built = build(group, settings)
        t3 = time.perf_counter()
        if not ready or built.samples is None:
            raise RuntimeError(f"{synthetic.group_id}: not built ({built.dropped})")
        events.encode(built.samples, producer="bench")
        t4 = time.perf_counter()
        for phase, (start, end) in zip(
            PHASES, ((t0, t1), (t1, t2), (t2, t3), (t3, t4)), strict=True
        ):
            seconds[phase] += end - start
        total += t4 - t0
        tokens += sum(len(s.token_ids) for s in built.samples.samples)
    return total, tokens


def concat_round(groups: list[SyntheticGroup]) -> float:
    """Seconds to concatenate every episode's calls' arrays (ids, and log-probs)."""
    parts = [
        (
            [a for call in episode for a in (call.prompt, call.completion)],
            [call.logprobs for call in episode],
        )
        for synthetic in groups
        for episode in synthetic.episodes
    ]
    started = time.perf_counter()
    for ids, logprobs in parts:
        np.concatenate(ids)
        np.concatenate(logprobs)
    return time.perf_counter() - started


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    episodes, calls = args.episodes, args.calls
    groups = [
        synthetic_group(rng, f"bench-g{args.seed}-{i}", episodes, calls) for i in range(args.groups)
    ]
    tokens = sum(g.sample_tokens for g in groups)
    prompts = [len(c.prompt) for g in groups for e in g.episodes for c in e]
    inputs = sum(len(c.prompt) + len(c.completion) for g in groups for e in g.episodes for c in e)
    log(
        f"{args.groups} groups x {episodes} episodes x {calls} calls, "
        f"{tokens / args.groups:,.0f} sample tokens per group"
    )
    phases = Phases()
    builder: list[float] = []
    concat: list[float] = []
    for r in range(args.rounds):
        seconds, emitted = builder_round(groups, phases)
        if emitted != tokens:
            raise RuntimeError(f"builder emitted {emitted} token ids, expected {tokens}")
        builder.append(seconds)
        concat.append(concat_round(groups))
        log(
            f"round {r + 1}/{args.rounds}: builder {tokens / builder[-1]:,.0f} tok/s "
            f"({args.groups / builder[-1]:,.1f} groups/s), "
            f"concat {tokens / concat[-1]:,.0f} tok/s"
        )
    builder_s, concat_s = statistics.median(builder), statistics.median(concat)
    spent = sum(phases.seconds.values())
    return {
        "tokens_per_s": round(tokens / builder_s),
        "groups_per_s": round(args.groups / builder_s, 2),
        "concat_tokens_per_s": round(tokens / concat_s),
        "ratio": round(concat_s / builder_s, 4),
        "ms_per_group": round(builder_s / args.groups * 1000, 3),
        "breakdown": {p: round(s / spent, 3) for p, s in phases.seconds.items()},
        "tokens_counted": "sample_token_ids",
        "sample_tokens_per_group": round(tokens / args.groups),
        "input_tokens_per_group": round(inputs / args.groups),
        "record_bytes_per_group": round(
            sum(len(v) for g in groups for _, v in g.records) / args.groups
        ),
        "episodes_per_group": episodes,
        "calls_per_episode": calls,
        "mean_prompt_tokens": round(statistics.mean(prompts)),
        "rounds": args.rounds,
        "groups": args.groups,
        "seed": args.seed,
    }


SHAPE_GROUPS = 8
"""Groups of 8 episodes built per episode shape."""
SHAPE_ROUNDS = 3
"""Rounds over them; the median is reported."""


def measure_shapes(seed: int, log: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """Per episode shape (bench/sample_shapes.py): the builder's sequence tokens over the
    least its chains need, sequences per episode, and calls built per second."""
    from harnessrl.bench.sample_shapes import SHAPES
    from harnessrl.services.sample_builder.config import SampleBuilderSection
    from harnessrl.trust.group import Group
    from harnessrl.trust.samples import build

    out: dict[str, dict[str, float]] = {}
    for name, play in SHAPES.items():
        rng = np.random.default_rng(seed)
        minimal = 0

        def episode(rng: np.random.Generator, play: Any = play) -> list[CallArrays]:
            nonlocal minimal
            calls, least = play(rng)
            minimal += least
            return [
                CallArrays(p, c, (-rng.exponential(0.5, len(c))).astype(np.float32))
                for p, c in calls
            ]

        groups = [
            synthetic_group(rng, f"shape-{name}-{i}", 8, 0, episode) for i in range(SHAPE_GROUPS)
        ]
        decoded = [[events.unwrap(events.decode(t, v))[1:] for t, v in g.records] for g in groups]
        calls = sum(len(e) for g in groups for e in g.episodes)
        rounds = []
        for _ in range(SHAPE_ROUNDS):
            started = time.perf_counter()
            sequences = tokens = 0
            for synthetic, records in zip(groups, decoded, strict=True):
                group = Group(synthetic.group_id, 0.0)
                for kind, event in records:
                    group.add(kind, event)
                built = build(group, SampleBuilderSection())
                assert built.samples is not None, built.dropped
                sequences += len(built.samples.samples)
                tokens += sum(len(s.token_ids) for s in built.samples.samples)
            rounds.append(time.perf_counter() - started)
        seconds = statistics.median(rounds)
        out[name] = {
            "sequence_tokens_over_minimal": round(tokens / minimal, 4),
            "sequences_per_episode": round(sequences / (8 * SHAPE_GROUPS), 2),
            "calls_per_s": round(calls / seconds),
        }
        log(
            f"shape {name}: {tokens / minimal:.3f}x the minimal sequence tokens, "
            f"{sequences / (8 * SHAPE_GROUPS):.2f} sequences/episode, "
            f"{calls / seconds:,.0f} calls/s (join + build)"
        )
    return out


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"bench samples: {line}", file=sys.stderr, flush=True)

    result = measure(args, log)
    result["shapes"] = measure_shapes(args.seed, log)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>24}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


def _model_call(
    episode_id: str, group_id: str, seq: int, call: CallArrays, *, trace_id: str, span_id: str
) -> pb.ModelCall:
    return pb.ModelCall(
        episode_id=episode_id,
        attempt=1,
        group_id=group_id,
        seq=seq,
        prompt_token_ids=call.prompt.tolist(),
        completion_token_ids=call.completion.tolist(),
        completion_logprobs=call.logprobs.tolist(),
        policy_version=3,
        temperature=1.0,
        trace_id=trace_id,
        span_id=span_id,
    )


def _ids(rng: np.random.Generator, n: int) -> npt.NDArray[np.uint32]:
    return rng.integers(0, VOCAB, n, dtype=np.uint32)
