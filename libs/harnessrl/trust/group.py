"""The join: one group's calls, closes, episodes and rewards, gathered from three topics.

Events arrive late, twice, or out of order (three topics, redelivery after restarts); `add`
is idempotent and order-free. A group is ready when its size is known and every episode's
final attempt is finished, closed with all `call_count` calls present, and rewarded.
Calls of attempts the controller retried are let go as soon as that is known.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from harnessrl.v1 import events_pb2 as pb

Key = tuple[str, int]  # (episode id, attempt)
MAX_COPIES = 4
"""Conflicting copies of one seq held for the merge; further ones are only counted (their
completion tokens, dropped as seq_conflict), so a sender that repeats a seq with new
contents cannot grow the builder's memory by whole calls."""


@dataclass(slots=True)
class AttemptCalls:
    calls: dict[int, pb.ModelCall] = field(default_factory=dict)
    """The first copy of each seq."""
    conflicts: dict[int, list[pb.ModelCall]] = field(default_factory=dict)
    """Further copies of a seq with other contents (a redelivered copy is the same), at most
    MAX_COPIES per seq."""
    overflow: dict[int, dict[bytes, int]] = field(default_factory=dict)
    """Copies past MAX_COPIES: seq -> {digest of the copy: its completion tokens}."""
    call_count: int | None = None
    """From EpisodeClosed; None until the gateway closed the attempt."""
    finished: pb.EpisodeFinished | None = None
    reward: pb.RewardAssigned | None = None

    def missing(self) -> str | None:
        """What this attempt still waits for ("finished", "closed", "calls", "reward")."""
        if self.finished is None:
            return "finished"
        if self.call_count is None:
            return "closed"
        if sum(1 for seq in self.calls if seq < self.call_count) < self.call_count:
            return "calls"
        if self.reward is None:
            return "reward"
        return None


@dataclass(frozen=True, slots=True)
class GroupEpisode:
    """An episode's final attempt, as far as it has arrived."""

    episode_id: str
    attempt: int
    index: int
    state: AttemptCalls

    @property
    def calls(self) -> list[pb.ModelCall]:
        """Calls with seq below call_count, in seq order, each distinct copy of a seq."""
        return [c for c in self._copies() if c.seq < self._limit]

    @property
    def beyond(self) -> list[pb.ModelCall]:
        """Calls numbered at or past the call_count the gateway closed the attempt with
        (never trained: the close says they were not part of it)."""
        return [c for c in self._copies() if c.seq >= self._limit]

    @property
    def every_call(self) -> list[pb.ModelCall]:
        return self._copies()

    def overflow(self, beyond: bool = False) -> tuple[int, int]:
        """(completion tokens, copies) of the copies past MAX_COPIES held only as counts:
        of seqs below call_count, or (`beyond`) at or past it."""
        tokens = copies = 0
        for seq, extra in self.state.overflow.items():
            if (seq >= self._limit) == beyond:
                tokens += sum(extra.values())
                copies += len(extra)
        return tokens, copies

    @property
    def _limit(self) -> int:
        return self.state.call_count if self.state.call_count is not None else 1 << 32

    def _copies(self) -> list[pb.ModelCall]:
        state = self.state
        out = []
        for seq in sorted(state.calls):
            out.append(state.calls[seq])
            out.extend(state.conflicts.get(seq, ()))
        return out


class Group:
    """What has arrived of one group. `first_seen` is in the caller's clock (seconds)."""

    def __init__(self, group_id: str, first_seen: float) -> None:
        self.group_id = group_id
        self.first_seen = first_seen
        self.task_id = ""
        self.size: int | None = None
        self.mode: int = pb.MODE_UNSPECIFIED
        self._index: dict[str, int] = {}
        self._attempts: dict[Key, AttemptCalls] = {}
        self._final: dict[str, int] = {}
        self._retried: set[Key] = set()

    def add(self, kind: str, event: object) -> None:
        """Take one event of the group (any order, any number of times)."""
        if kind == "episode_started":
            self._started(event)  # type: ignore[arg-type]
            return
        key = (event.episode_id, event.attempt)  # type: ignore[attr-defined]
        if key in self._retried:
            return
        attempt = self._attempts.setdefault(key, AttemptCalls())
        if kind == "model_call":
            call: pb.ModelCall = event  # type: ignore[assignment]
            held = attempt.calls.setdefault(call.seq, call)
            if held is not call and held != call:
                copies = attempt.conflicts.setdefault(call.seq, [])
                if all(copy != call for copy in copies):
                    if len(copies) < MAX_COPIES:
                        copies.append(call)
                    else:
                        digest = hashlib.blake2b(
                            call.SerializeToString(deterministic=True), digest_size=16
                        ).digest()
                        extra = attempt.overflow.setdefault(call.seq, {})
                        extra[digest] = len(call.completion_token_ids)
        elif kind == "episode_closed":
            attempt.call_count = event.call_count  # type: ignore[attr-defined]
        elif kind == "episode_finished":
            self._finished(key, attempt, event)  # type: ignore[arg-type]
        elif kind == "reward_assigned":
            attempt.reward = event  # type: ignore[assignment]

    def _started(self, event: pb.EpisodeStarted) -> None:
        self.size = event.group_size or self.size
        self.task_id = event.task_id or self.task_id
        self.mode = event.mode or self.mode
        self._index[event.episode_id] = event.index

    def _finished(self, key: Key, attempt: AttemptCalls, event: pb.EpisodeFinished) -> None:
        attempt.finished = event
        self.task_id = event.task_id or self.task_id
        self.mode = event.mode or self.mode
        if event.final:
            self._final[event.episode_id] = event.attempt
        else:  # retried: its calls never feed training
            self._retried.add(key)
            del self._attempts[key]

    @property
    def ready(self) -> bool:
        return (
            self.size is not None
            and len(self._final) >= self.size
            and all(e.state.missing() is None for e in self.episodes())
        )

    def episodes(self) -> list[GroupEpisode]:
        """Final attempts known so far, ordered by their index in the group."""
        out = [
            GroupEpisode(
                episode_id, attempt, self._index.get(episode_id, 1 << 32), self._state(key)
            )
            for episode_id, attempt in self._final.items()
            for key in [(episode_id, attempt)]
        ]
        return sorted(out, key=lambda e: (e.index, e.episode_id))

    def _state(self, key: Key) -> AttemptCalls:
        return self._attempts.setdefault(key, AttemptCalls())

    def missing(self) -> Iterator[str]:
        """Why the group is not ready, for logs and the timeout path."""
        if self.size is None:
            yield "size"
        elif len(self._final) < self.size:
            yield f"finished:{len(self._final)}/{self.size}"
        for episode in self.episodes():
            what = episode.state.missing()
            if what:
                yield f"{episode.episode_id}:{what}"
