"""What happens to an episode: its phases, the verdict on a run, and what was already done.

An episode attempt moves PENDING -> RUNNING -> CLOSING -> FINISHED, and `advance()` is the
one place that checks a move is allowed. When a run ends, `judge()` decides the episode
status and whether the episode gets another attempt. The `EpisodeLedger` is what the topic
hrl.episodes says was started and finished, so a restarted controller resumes groups where
its predecessor left them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from harnessrl.services.controller.runner import RunResult
from harnessrl.v1 import events_pb2 as pb


class Phase(enum.Enum):
    PENDING = "pending"  # waiting for a launch slot (and, in sync mode, for the engines)
    RUNNING = "running"  # the harness runs
    CLOSING = "closing"  # the harness ended; closing the episode at the gateway
    FINISHED = "finished"  # EpisodeFinished published


ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.PENDING: frozenset({Phase.RUNNING, Phase.FINISHED}),  # FINISHED: refused unlaunched
    Phase.RUNNING: frozenset({Phase.CLOSING}),
    Phase.CLOSING: frozenset({Phase.FINISHED}),
    Phase.FINISHED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A bug: an episode was moved in a way the lifecycle does not allow."""


@dataclass
class AttemptState:
    episode_id: str
    attempt: int
    phase: Phase = Phase.PENDING

    def advance(self, to: Phase) -> None:
        """Move to `to`; raises IllegalTransition for a move ALLOWED does not list."""
        if to not in ALLOWED[self.phase]:
            raise IllegalTransition(
                f"episode {self.episode_id} attempt {self.attempt}: {self.phase.value} -> "
                f"{to.value} is not allowed"
            )
        self.phase = to


@dataclass(frozen=True, slots=True)
class Verdict:
    status: pb.EpisodeStatus.ValueType
    reason: str
    retry: bool


def judge(
    result: RunResult, *, attempt: int, max_attempts: int, retryable_exit_codes: frozenset[int]
) -> Verdict:
    """The episode status of a run, and whether the episode is tried again.

    Retried (while attempts remain): infrastructure failures, abandoned runs, crashes
    (killed by a signal) and the configured retryable exit codes. Final: success, timeouts,
    other non-zero exits, and a malformed result.
    """
    more = attempt < max_attempts
    if result.outcome == "timeout":
        return Verdict(pb.EPISODE_STATUS_TIMEOUT, result.message, False)
    if result.outcome in ("infra_error", "abandoned"):
        return Verdict(pb.EPISODE_STATUS_FAILED, result.message, more)
    code = result.exit_code
    if code == 0:
        if result.result_error:
            return Verdict(pb.EPISODE_STATUS_FAILED, result.result_error, False)
        return Verdict(pb.EPISODE_STATUS_SUCCEEDED, "", False)
    if code is not None and code < 0:
        return Verdict(pb.EPISODE_STATUS_FAILED, f"crashed: killed by signal {-code}", more)
    if code in retryable_exit_codes:
        return Verdict(pb.EPISODE_STATUS_FAILED, f"exit code {code} (retryable)", more)
    return Verdict(pb.EPISODE_STATUS_FAILED, f"exit code {code}", False)


@dataclass
class EpisodeRecord:
    """What the topic says of one episode (all attempts)."""

    started: int = 0  # highest attempt started
    finished: dict[int, bool] = field(default_factory=dict)  # attempt -> final?

    @property
    def done(self) -> bool:
        return any(self.finished.values())

    @property
    def open_attempt(self) -> int | None:
        """The attempt started and not finished, if any."""
        if self.started and self.started not in self.finished:
            return self.started
        return None


class EpisodeLedger:
    """Episodes as hrl.episodes records them, by group; fed in topic order."""

    def __init__(self) -> None:
        self.groups: dict[str, dict[str, EpisodeRecord]] = {}

    def add(self, kind: str, event: object) -> None:
        if kind == "episode_started":
            started: pb.EpisodeStarted = event  # type: ignore[assignment]
            record = self._record(started.group_id, started.episode_id)
            record.started = max(record.started, started.attempt)
        elif kind == "episode_finished":
            finished: pb.EpisodeFinished = event  # type: ignore[assignment]
            record = self._record(finished.group_id, finished.episode_id)
            record.finished[finished.attempt] = finished.final

    def episode(self, group_id: str, episode_id: str) -> EpisodeRecord:
        return self.groups.get(group_id, {}).get(episode_id) or EpisodeRecord()

    def forget(self, group_id: str) -> None:
        self.groups.pop(group_id, None)

    def _record(self, group_id: str, episode_id: str) -> EpisodeRecord:
        return self.groups.setdefault(group_id, {}).setdefault(episode_id, EpisodeRecord())
