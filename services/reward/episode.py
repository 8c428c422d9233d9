"""What a reward sees and what it returns: a typed finished episode, and a score.

A reward function receives an `Episode` (never the raw event) and returns a number, a
`Score`, or a mapping with the same fields. Everything a reward may use was collected by
the controller; nothing comes from the harness except its result and artifacts.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import orjson

from harnessrl.v1 import events_pb2 as pb

_STATUS = {
    pb.EPISODE_STATUS_SUCCEEDED: "succeeded",
    pb.EPISODE_STATUS_FAILED: "failed",
    pb.EPISODE_STATUS_TIMEOUT: "timeout",
    pb.EPISODE_STATUS_INVALID: "invalid",
}
_MODE = {pb.MODE_TRAIN: "train", pb.MODE_VAL: "val"}


@dataclass(frozen=True, slots=True)
class Episode:
    """A finished episode attempt, as the controller reported it."""

    episode_id: str
    attempt: int
    group_id: str
    task_id: str
    mode: str
    """"train" or "val"."""
    status: str
    """"succeeded", "failed", "timeout" or "invalid"."""
    reason: str
    """Why the status is not "succeeded", in words; "" otherwise."""
    exit_code: int | None
    task_input: Any
    """The task input (parsed JSON), as the harness received it."""
    task_metadata: Mapping[str, Any]
    """The task metadata (expected answer, repository, tests...): never shown to the harness."""
    result: Any
    """The harness's result (parsed JSON); None when it reported none, or the report was
    truncated or not JSON."""
    result_json: str
    artifacts_dir: Path | None
    """Local directory of the run's artifacts (logs, patch, files), when it is on this
    machine (a file:// artifacts URI); None otherwise."""
    artifacts_uri: str
    started_at: float
    """Unix seconds."""
    finished_at: float
    """Unix seconds."""
    policy_version: int
    event: pb.EpisodeFinished = field(repr=False, compare=False)
    """The event itself, for rewards that forward it (the gRPC client)."""

    @property
    def duration_s(self) -> float:
        return max(0.0, self.finished_at - self.started_at)

    @classmethod
    def from_event(cls, event: pb.EpisodeFinished) -> Episode:
        """Raises ValueError naming the field when the event cannot be scored."""
        if not event.episode_id:
            raise ValueError("EpisodeFinished.episode_id: required")
        try:
            task_input = orjson.loads(event.task_input_json or "null")
        except orjson.JSONDecodeError as err:
            raise ValueError(f"EpisodeFinished.task_input_json: not JSON ({err})") from None
        try:
            metadata = orjson.loads(event.task_metadata_json or "{}")
        except orjson.JSONDecodeError as err:
            raise ValueError(f"EpisodeFinished.task_metadata_json: not JSON ({err})") from None
        if not isinstance(metadata, dict):
            raise ValueError("EpisodeFinished.task_metadata_json: not a JSON object")
        result: Any = None
        if event.result_json and not event.result_truncated:
            try:
                result = orjson.loads(event.result_json)
            except orjson.JSONDecodeError:
                result = None  # the controller reports it as failed; the reward sees none
        return cls(
            episode_id=event.episode_id,
            attempt=event.attempt,
            group_id=event.group_id,
            task_id=event.task_id,
            mode=_MODE.get(event.mode, "train"),
            status=_STATUS.get(event.status, "invalid"),
            reason=event.reason,
            exit_code=event.exit_code if event.HasField("exit_code") else None,
            task_input=task_input,
            task_metadata=metadata,
            result=result,
            result_json=event.result_json,
            artifacts_dir=_local_dir(event.artifacts_uri),
            artifacts_uri=event.artifacts_uri,
            started_at=event.started_at.ToNanoseconds() / 1e9,
            finished_at=event.finished_at.ToNanoseconds() / 1e9,
            policy_version=event.policy_version,
            event=event,
        )


def standalone_episode(
    metadata: Mapping[str, Any],
    *,
    result: Any,
    mode: str = "train",
    artifacts_dir: Path | None = None,
    task_input: Any = None,
) -> Episode:
    """A finished episode made outside the reward service (a benchmark, a task validation,
    a test): the task's metadata and the harness's result as given, everything else
    neutral (a succeeded attempt 0 of one task, exit code 0)."""
    return Episode(
        episode_id="ep-1",
        attempt=0,
        group_id="group-1",
        task_id="task-1",
        mode=mode,
        status="succeeded",
        reason="",
        exit_code=0,
        task_input=task_input,
        task_metadata=metadata,
        result=result,
        result_json="",
        artifacts_dir=artifacts_dir,
        artifacts_uri=artifacts_dir.as_uri() if artifacts_dir else "",
        started_at=0.0,
        finished_at=1.0,
        policy_version=0,
        event=pb.EpisodeFinished(),
    )


def _local_dir(uri: str) -> Path | None:
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        return None
    return Path(unquote(parsed.path))


@dataclass(frozen=True, slots=True)
class Score:
    """A reward's answer: the value, its named parts, and flags raised while scoring."""

    value: float
    components: Mapping[str, float] = field(default_factory=dict)
    flags: tuple[str, ...] = ()
    message: str = ""


class InvalidScore(ValueError):
    """The reward returned something that is not a usable score (named in the message)."""


def to_score(returned: Any) -> Score:
    """Coerce what a reward function returned into a Score.

    Accepts a real number (not bool), a Score, or a mapping with "value" and optional
    "components", "flags", "message". Raises InvalidScore naming the field; a non-finite
    value or component raises InvalidScore with "non_finite" in the message.
    """
    if isinstance(returned, Score):
        score = returned
    elif isinstance(returned, Mapping):
        unknown = set(returned) - {"value", "components", "flags", "message"}
        if unknown:
            raise InvalidScore(f"score: unknown fields {sorted(unknown)}")
        if "value" not in returned:
            raise InvalidScore("score.value: required")
        flags = returned.get("flags", ())
        if isinstance(flags, str) or not all(isinstance(f, str) for f in flags):
            raise InvalidScore("score.flags: must be a list of strings")
        score = Score(
            value=_number("score.value", returned["value"]),
            components=dict(returned.get("components") or {}),
            flags=tuple(flags),
            message=str(returned.get("message", "")),
        )
    else:
        score = Score(value=_number("score", returned))
    value = _number("score.value", score.value)
    components = {}
    for name, part in score.components.items():
        if not isinstance(name, str) or not name:
            raise InvalidScore(f"score.components: names must be non-empty strings, got {name!r}")
        components[name] = _number(f"score.components[{name!r}]", part)
    return Score(value, components, tuple(dict.fromkeys(score.flags)), score.message)


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidScore(f"{where}: expected a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidScore(f"{where}: non_finite value {number}")
    return number
