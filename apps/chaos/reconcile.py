"""Did the faults lose or double anything? Counted from the topics and the services' own
records, never from the fault injector's expectations.

- calls answered: what each harness says it got back. The calculator harness's result
  carries `calls`, the model calls it made that returned; an attempt killed before it wrote
  a result (`attempts_without_result`: its controller was killed) is counted from the
  `progress.json` the harness rewrites after each answer (a lower bound: a kill between an
  answer and that write leaves the count one short).
- calls captured: distinct `ModelCall`s on hrl.calls, by (episode, attempt, seq). The same
  id with different tokens (a call number handed out twice) is `calls_conflicting`.
- calls lost: per attempt, answered calls beyond those captured.
- samples trained twice: from the trainer's step journal, samples in two steps of the
  lineage of its current weights (steps thrown away with a crash do not count).
- episodes unaccounted: of the episodes the submitted groups call for, those whose last
  attempt has no `EpisodeFinished`.
- tokens, itemized: completion tokens captured (every distinct call) = trained (loss-mask
  tokens of the samples the trainer trained on: its lineage's and a rewind's retired
  versions') + dropped by the sample builder,
  by reason (the GroupSamples token books) + dropped by the trainer, by reason
  (PolicyVersion.tokens_dropped: stale, too_stale, deleted) + pending (samples published,
  neither trained nor dropped when the run stopped) + of attempts the
  controller retried (never in a group's books) + of groups no GroupSamples was published
  for (`not_built`: waiting, or dropped whole); `tokens_unexplained` is what is left, 0 when
  the books balance.
- production sessions (production_traffic.py): calls the app was answered vs captured, and
  every signal the feedback API accepted joined exactly once into its session's one reward
  (`signals_missing`, `signals_doubled`, `rewards_conflicting` are 0 when it holds).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from harnessrl.services.trainer import journal as trainer_journal

Attempt = tuple[str, int]  # (episode id, attempt)


@dataclass(slots=True)
class Books:
    """What the topics say, fed one decoded event at a time."""

    groups: dict[str, int] = field(default_factory=dict)
    """Submitted group id -> episodes it calls for."""
    started: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    """Episode id -> attempts started."""
    finished: dict[Attempt, Any] = field(default_factory=dict)
    """Attempt -> its EpisodeFinished."""
    episode_group: dict[str, str] = field(default_factory=dict)
    calls: dict[tuple[str, int, int], tuple[int, ...]] = field(default_factory=dict)
    """(episode, attempt, seq) -> completion token ids."""
    conflicting: int = 0
    closed: dict[Attempt, int] = field(default_factory=dict)
    """Attempt -> call_count of its EpisodeClosed."""
    sample_tokens: dict[str, int] = field(default_factory=dict)
    """Sample id -> completion tokens (loss mask 1)."""
    groups_emitted: set[str] = field(default_factory=set)
    progress: dict[Attempt, int] = field(default_factory=dict)
    """Attempt -> calls its harness recorded as answered before it was killed (or ended)."""
    group_books: dict[str, Any] = field(default_factory=dict)
    """Group id -> the token books of its GroupSamples."""
    sample_group: dict[str, str] = field(default_factory=dict)
    rewards: dict[str, set[bytes]] = field(default_factory=dict)
    """Session group -> the distinct RewardAssigned published for it (serialised)."""
    reward_keys: dict[str, list[str]] = field(default_factory=dict)
    """Session group -> the idempotency keys of its reward's signals."""
    told: list[Any] = field(default_factory=list)
    """What the production app was told (production_traffic.TrafficSession)."""
    trainer_dropped: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Tokens the trainer dropped, by reason, from the versions it announced."""

    def sessions_told(self, records: Iterable[Any]) -> None:
        self.told = list(records)

    def apply(self, kind: str, event: Any) -> None:
        if kind == "task_submitted":
            self.groups[event.group_id] = max(1, event.group_size)
        elif kind == "episode_started" and not event.session.app:
            self.started[event.episode_id].add(event.attempt)
            self.episode_group[event.episode_id] = event.group_id
        elif kind == "episode_finished" and not event.session.app:
            self.finished[(event.episode_id, event.attempt)] = event
            self.episode_group[event.episode_id] = event.group_id
        elif kind == "model_call":
            key = (event.episode_id, event.attempt, event.seq)
            tokens = tuple(event.completion_token_ids)
            if key in self.calls and self.calls[key] != tokens:
                self.conflicting += 1
            self.calls.setdefault(key, tokens)
        elif kind == "episode_closed":
            self.closed[(event.episode_id, event.attempt)] = event.call_count
        elif kind == "group_samples":
            self.groups_emitted.add(event.group_id)
            self.group_books.setdefault(event.group_id, event.books)
            for sample in event.samples:
                self.sample_tokens[sample.sample_id] = sum(1 for m in sample.loss_mask if m)
                self.sample_group[sample.sample_id] = event.group_id
        elif kind == "policy_version":
            for reason, tokens in event.tokens_dropped.items():
                self.trainer_dropped[reason] += tokens
        elif kind == "reward_assigned" and event.session.app:
            self.rewards.setdefault(event.group_id, set()).add(
                event.SerializeToString(deterministic=True)
            )
            self.reward_keys[event.group_id] = [s.idempotency_key for s in event.signals]


def reconcile(books: Books, journal: Iterable[trainer_journal.Record]) -> dict[str, Any]:
    """The figures of a run (see the module docstring)."""
    records = list(journal)
    captured: dict[Attempt, int] = defaultdict(int)
    for episode_id, attempt, _ in books.calls:
        captured[(episode_id, attempt)] += 1
    answered = lost = without_result = 0
    every_attempt = set(books.finished) | {
        (e, a) for e, started in books.started.items() for a in started
    }
    for key in every_attempt:
        finished = books.finished.get(key)
        calls = _answered(finished.result_json) if finished is not None else None
        if calls is None:
            without_result += 1
            calls = books.progress.get(key, 0)
        answered += calls
        lost += max(0, calls - captured[key])
    closed_short = sum(1 for key, count in books.closed.items() if count < captured[key])
    steps = trainer_journal.trained(records)  # retired versions' steps trained theirs too
    trained = [s for step in steps for s in step.samples]
    episodes_by_group: dict[str, set[str]] = defaultdict(set)
    for episode_id, group_id in books.episode_group.items():
        episodes_by_group[group_id].add(episode_id)
    unaccounted = 0
    for group_id, size in books.groups.items():
        episodes = episodes_by_group.get(group_id, set())
        unaccounted += max(0, size - len(episodes))  # never started
        for episode_id in episodes:
            attempts = books.started.get(episode_id, set()) | {
                a for (e, a) in books.finished if e == episode_id
            }
            if (episode_id, max(attempts)) not in books.finished:
                unaccounted += 1
    return {
        "calls_answered": answered,
        "calls_captured": len(books.calls),
        "calls_lost": lost,
        "calls_conflicting": books.conflicting,
        "closed_short": closed_short,
        "attempts_without_result": without_result,
        "groups": len(books.groups),
        "episodes": sum(books.groups.values()),
        "episodes_retried": sum(1 for a in books.started.values() if len(a) > 1),
        "episodes_unaccounted": unaccounted,
        "steps": len(steps),
        "samples_trained": len(trained),
        "samples_trained_twice": len(trainer_journal.trained_twice(records)),
        **_tokens(books, trained),
        **_sessions(books, captured),
    }


def _tokens(books: Books, trained: list[str]) -> dict[str, Any]:
    """The token books of the run, itemized (module docstring); a sample trained twice
    counts twice, so the books do not balance then."""
    group_of = dict(books.episode_group)
    captured = 0
    retried = 0
    unbuilt = 0
    for (episode_id, attempt, _), tokens in books.calls.items():
        captured += len(tokens)
        finished = books.finished.get((episode_id, attempt))
        group = group_of.get(episode_id, episode_id)
        if finished is not None and not finished.final:
            retried += len(tokens)
        elif group not in books.group_books:
            unbuilt += len(tokens)
    dropped: dict[str, int] = defaultdict(int)
    for group_books in books.group_books.values():
        for reason, count in group_books.dropped.items():
            dropped[reason] += count
    once = set(trained)
    after = sum(n for s, n in books.sample_tokens.items() if s not in once)
    for reason, count in books.trainer_dropped.items():
        dropped[f"trainer:{reason}"] += count
    pending = after - sum(books.trainer_dropped.values())
    trained_tokens = sum(books.sample_tokens.get(s, 0) for s in trained)
    accounted = trained_tokens + sum(dropped.values()) + pending + retried + unbuilt
    return {
        "tokens_captured": captured,
        "tokens_trained": trained_tokens,
        "tokens_dropped": dict(sorted(dropped.items())),
        "tokens_pending_at_stop": pending,
        "tokens_of_retried_attempts": retried,
        "tokens_not_built": unbuilt,
        "tokens_unexplained": captured - accounted,
    }


def _sessions(books: Books, captured: dict[Attempt, int]) -> dict[str, Any]:
    """Production sessions: calls answered vs captured, signals accepted vs joined."""
    if not books.told:
        return {}
    answered = lost = accepted = joined = missing = doubled = waiting = rewarded = 0
    for record in books.told:
        group = f"s.chaos.{record.session_id}"
        answered += record.answered
        lost += max(0, record.answered - captured.get((group, 1), 0))
        accepted += len(record.signals)
        keys = books.reward_keys.get(group)
        rewarded += group in books.rewards
        if keys is None:
            waiting += len(record.signals)
            continue
        doubled += len(keys) - len(set(keys))
        joined += len(set(keys) & set(record.signals))
        missing += len(set(record.signals) - set(keys))
    return {
        "sessions": len(books.told),
        "sessions_calls_answered": answered,
        "sessions_calls_lost": lost,
        "sessions_rewarded": sum(
            1 for r in books.told if f"s.chaos.{r.session_id}" in books.rewards
        ),
        "signals_accepted": accepted,
        "signals_joined": joined,
        "signals_missing": missing,
        "signals_doubled": doubled,
        "signals_awaiting_a_reward": waiting,
        "rewards_conflicting": sum(1 for found in books.rewards.values() if len(found) > 1),
    }


def _answered(result_json: str) -> int | None:
    try:
        result = json.loads(result_json) if result_json else None
    except ValueError:
        return None
    calls = result.get("calls") if isinstance(result, dict) else None
    return calls if isinstance(calls, int) and calls >= 0 else None
