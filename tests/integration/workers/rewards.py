"""Reward functions as users write them, loaded by the reward service as entry points.

`by_behaviour` does what the task metadata's "behaviour" says, so one service run can show
that a reward that raises, hangs or returns NaN leaves the service scoring the rest.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

from harnessrl.services.reward.episode import Episode, Score

_tries: Counter[str] = Counter()


def answer_length(episode: Episode) -> float:
    """Sync: the length of the answer, with the status as a component."""
    answer = str((episode.result or {}).get("answer", ""))
    return float(len(answer))


async def by_behaviour(episode: Episode) -> Score | float | dict[str, object]:
    behaviour = episode.task_metadata.get("behaviour", "ok")
    if behaviour == "ok":
        return Score(
            1.0 if episode.status == "succeeded" else 0.0,
            {"succeeded": float(episode.status == "succeeded")},
            ("checked",),
            f"answer={(episode.result or {}).get('answer')}",
        )
    if behaviour == "mapping":
        return {"value": 0.5, "components": {"half": 0.5}, "flags": ["partial"]}
    if behaviour == "raise":
        raise RuntimeError("the judge crashed")
    if behaviour == "hang":
        await asyncio.sleep(3600)
    if behaviour == "nan":
        return math.nan
    if behaviour == "not_a_number":
        return {"value": "high"}
    if behaviour == "flaky":
        _tries[episode.episode_id] += 1
        if _tries[episode.episode_id] < 3:
            raise ConnectionError("judge unreachable")
        return 0.25
    raise ValueError(f"unknown behaviour {behaviour!r}")


def sync_hang(episode: Episode) -> float:
    """Sync and ignoring its timeout (a thread cannot be killed)."""
    if episode.task_metadata.get("behaviour") == "hang":
        time.sleep(5)
    return 1.0


def by_index(episode: Episode) -> float:
    """The episode's index in its group ("<group>-<index>"): distinct rewards per group."""
    return float(episode.episode_id.rsplit("-", 1)[1])
