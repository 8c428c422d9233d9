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
- tokens: completion tokens captured, and completion tokens (loss-mask 1) of the samples
  the trainer's lineage trained on.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from harnessrl.services.trainer.journal import Resume, StepRecord, lineage, trained_twice

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

    def apply(self, kind: str, event: Any) -> None:
        if kind == "task_submitted":
            self.groups[event.group_id] = max(1, event.group_size)
        elif kind == "episode_started":
            self.started[event.episode_id].add(event.attempt)
            self.episode_group[event.episode_id] = event.group_id
        elif kind == "episode_finished":
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
            for sample in event.samples:
                self.sample_tokens[sample.sample_id] = sum(1 for m in sample.loss_mask if m)


def reconcile(books: Books, journal: Iterable[StepRecord | Resume]) -> dict[str, Any]:
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
    steps = lineage(records)
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
        "samples_trained_twice": len(trained_twice(records)),
        "tokens_captured": sum(len(tokens) for tokens in books.calls.values()),
        "tokens_trained": sum(books.sample_tokens.get(s, 0) for s in trained),
    }


def _answered(result_json: str) -> int | None:
    try:
        result = json.loads(result_json) if result_json else None
    except ValueError:
        return None
    calls = result.get("calls") if isinstance(result, dict) else None
    return calls if isinstance(calls, int) and calls >= 0 else None
