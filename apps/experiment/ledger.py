"""What an experiment knows about its run, built only from the events on the topics.

The experiment submits groups in phases (val before, train, val after); the ledger follows
every episode of those groups to its final attempt and that attempt's reward, and keeps
what the report needs: per-episode rewards, the calls' tokens and policy versions, the
trainer's steps, the engines' loaded versions and the sample builder's merge statistics.
Pure: it takes decoded events and answers questions, so it is tested without a broker.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

VAL_BEFORE, TRAIN, VAL_AFTER = "val_before", "train", "val_after"


@dataclass(slots=True)
class RunEpisode:
    group_id: str
    final_attempt: int | None = None
    finished_at: float | None = None
    """Unix seconds the final attempt ended."""
    rewards: dict[int, float] = field(default_factory=dict)
    """Reward by attempt (a missing reward counts as 0)."""
    versions: set[int] = field(default_factory=set)
    """Policy versions that served the episode's calls."""

    @property
    def reward(self) -> float | None:
        """The final attempt's reward, once both are known."""
        if self.final_attempt is None:
            return None
        return self.rewards.get(self.final_attempt)


@dataclass(slots=True)
class GroupRecord:
    group_id: str
    task_id: str
    phase: str
    size: int
    episodes: dict[str, RunEpisode] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.episodes) >= self.size and all(
            e.reward is not None for e in self.episodes.values()
        )


@dataclass(frozen=True, slots=True)
class Step:
    at: float
    """Unix seconds the experiment saw the version announced."""
    step: int
    version: int


BREAKS = ("chat_template", "retokenization", "compaction", "side_chain", "other")
"""The sample builder's break classes (MergeStats.break_<name>)."""


class RunLedger:
    """The run as the topics tell it."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupRecord] = {}
        self._episode_group: dict[str, str] = {}
        self.steps: list[Step] = []
        self.loaded: dict[str, int] = {}
        """Newest version each engine reported loading (ok)."""
        self.calls: list[tuple[float, int, int, str]] = []
        """Calls of train episodes: (unix seconds, prompt tokens, completion tokens, group)."""
        self.merge: Counter[str] = Counter()
        self.emitted: list[str] = []
        """Train groups the sample builder published samples of, in order."""

    def submitted(self, group_id: str, task_id: str, phase: str, size: int) -> None:
        self.groups[group_id] = GroupRecord(group_id, task_id, phase, size)

    def apply(self, kind: str, event: Any, at: float) -> None:
        """One decoded event (`at`: when it was produced, unix seconds)."""
        if kind == "policy_version":
            self.steps.append(Step(at, event.step, event.version))
        elif kind == "policy_loaded":
            if event.ok:
                engine = event.engine or "engine"
                self.loaded[engine] = max(self.loaded.get(engine, 0), event.version)
        elif kind == "group_samples":
            if event.group_id in self.groups:
                if not event.dropped_reason:  # one that trains nothing comes for its books
                    self.emitted.append(event.group_id)
                for name in ("calls", "segments", "duplicates_replaced"):
                    self.merge[name] += getattr(event.merge, name)
                for name in BREAKS:
                    self.merge[f"break_{name}"] += getattr(event.merge, f"break_{name}")
                # The token books: where the captured completion tokens went.
                books = event.books
                self.merge["tokens_captured"] += books.captured
                self.merge["tokens_trained"] += books.trained
                for reason, tokens in sorted(books.dropped.items()):
                    self.merge[f"tokens_dropped_{reason}"] += tokens
        elif getattr(event, "group_id", "") in self.groups:
            self._episode_event(kind, event, at)

    def _episode_event(self, kind: str, event: Any, at: float) -> None:
        group = self.groups[event.group_id]
        if kind == "episode_started":
            group.episodes.setdefault(event.episode_id, RunEpisode(event.group_id))
            return
        episode = group.episodes.setdefault(event.episode_id, RunEpisode(event.group_id))
        if kind == "episode_finished" and event.final:
            episode.final_attempt = event.attempt
            episode.finished_at = event.finished_at.ToSeconds() or at
        elif kind == "reward_assigned":
            episode.rewards[event.attempt] = 0.0 if event.missing else event.value
        elif kind == "model_call":
            episode.versions.add(event.policy_version)
            if group.phase == TRAIN:
                prompt, completion = len(event.prompt_token_ids), len(event.completion_token_ids)
                self.calls.append((at, prompt, completion, event.group_id))

    # --- questions -------------------------------------------------------------------

    def phase(self, phase: str) -> list[GroupRecord]:
        return [g for g in self.groups.values() if g.phase == phase]

    def outstanding(self, phase: str) -> int:
        """Groups of `phase` not done yet."""
        return sum(1 for g in self.phase(phase) if not g.done)

    def episodes_done(self, phase: str) -> list[RunEpisode]:
        return [e for g in self.phase(phase) for e in g.episodes.values() if e.reward is not None]

    @property
    def step(self) -> int:
        return max((s.step for s in self.steps), default=0)

    @property
    def version(self) -> int:
        return max((s.version for s in self.steps), default=0)

    def engines_serve(self, version: int) -> bool:
        """Whether every engine that reported a load serves `version` or newer."""
        return bool(self.loaded) and min(self.loaded.values()) >= version

    def evaluation(self, phase: str) -> dict[str, Any]:
        """Mean reward of the phase's episodes (for 0/1 rewards: the success rate), the
        versions that served them, and the same by kind of task (the task id up to its
        first "-")."""
        by_kind: dict[str, list[float]] = {}
        versions: set[int] = set()
        rewards = []
        for group in self.phase(phase):
            kind = group.task_id.split("-", 1)[0]
            for episode in group.episodes.values():
                reward = episode.reward
                if reward is None:
                    continue
                rewards.append(reward)
                by_kind.setdefault(kind, []).append(reward)
                versions |= episode.versions
        return {
            "success": _mean(rewards),
            "episodes": len(rewards),
            "versions": sorted(versions),
            "by_kind": {k: {"n": len(v), "success": _mean(v)} for k, v in sorted(by_kind.items())},
        }

    def train_episodes(self, since: float) -> list[dict[str, Any]]:
        rows = []
        for group in self.phase(TRAIN):
            for episode in group.episodes.values():
                if episode.reward is None or episode.finished_at is None:
                    continue
                rows.append(
                    {
                        "t": round(episode.finished_at - since, 3),
                        "reward": episode.reward,
                        "version": max(episode.versions, default=0),
                    }
                )
        return sorted(rows, key=lambda row: row["t"])

    def sampled_episodes(self) -> list[str]:
        """Episodes of the groups with samples, oldest group first."""
        return [e for g in self.emitted for e in self.groups[g].episodes]

    def train_calls(self, since: float) -> list[dict[str, Any]]:
        return [
            {"t": round(at - since, 3), "prompt_tokens": p, "completion_tokens": c}
            for at, p, c, _ in sorted(self.calls)
        ]


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else 0.0


KINDS = {
    "episode_started",
    "episode_finished",
    "reward_assigned",
    "model_call",
    "policy_version",
    "policy_loaded",
    "group_samples",
}
"""The events the ledger reads (envelope field names)."""
