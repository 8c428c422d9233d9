"""One episode in, one RewardAssigned out, whatever the reward does.

The reward may return a bad value, raise, hang or flap: `assign` always returns an event.
Transient errors are retried (classified by harnessrl.retry); a call past its timeout, a
final error or an unusable value gives `missing` with the reason and a flag saying which.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, PermanentError, retry
from harnessrl.services.reward.episode import Episode, InvalidScore, Score, to_score
from harnessrl.services.reward.sources import Scorer
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

# Flags of a missing reward: why it is missing.
NON_FINITE = "non_finite"
INVALID_SCORE = "invalid_score"
REWARD_TIMEOUT = "reward_timeout"
REWARD_ERROR = "reward_error"


@dataclass(frozen=True, slots=True)
class CallPolicy:
    timeout_s: float
    max_retries: int
    backoff_s: float


class _CallTimedOut(PermanentError):
    """This service's per-call timeout (not a TimeoutError raised inside the reward, which
    counts as transient)."""


async def assign(scorer: Scorer, episode: Episode, policy: CallPolicy) -> pb.RewardAssigned:
    """Score `episode` with `scorer`; never raises except CancelledError."""
    started = time.perf_counter()

    async def attempt() -> Score:
        deadline = asyncio.timeout(policy.timeout_s)
        try:
            async with deadline:
                returned = await scorer.score(episode)
        except TimeoutError:
            if deadline.expired():
                raise _CallTimedOut(f"no score within {policy.timeout_s:g} s") from None
            raise
        return to_score(returned)

    def retrying(number: int, error: BaseException) -> None:
        log.warning(
            "reward call failed, retrying",
            episode_id=episode.episode_id,
            attempt=number,
            error=repr(error),
        )

    try:
        score = await retry(
            attempt,
            backoff=Backoff(policy.backoff_s, 30.0),
            max_attempts=policy.max_retries + 1,
            on_retry=retrying,
        )
    except InvalidScore as err:
        flag = NON_FINITE if "non_finite" in str(err) else INVALID_SCORE
        return _missing(scorer, episode, started, f"refused: {err}", flag)
    except _CallTimedOut as err:
        return _missing(scorer, episode, started, f"timeout: {err}", REWARD_TIMEOUT)
    except Exception as err:
        return _missing(
            scorer, episode, started, f"reward failed: {type(err).__name__}: {err}", REWARD_ERROR
        )
    return pb.RewardAssigned(
        episode_id=episode.episode_id,
        attempt=episode.attempt,
        group_id=episode.group_id,
        value=score.value,
        components=dict(score.components),
        flags=list(score.flags),
        source=scorer.source,
        latency_ms=(time.perf_counter() - started) * 1000,
        message=score.message,
    )


def _missing(
    scorer: Scorer, episode: Episode, started: float, message: str, flag: str
) -> pb.RewardAssigned:
    return pb.RewardAssigned(
        episode_id=episode.episode_id,
        attempt=episode.attempt,
        group_id=episode.group_id,
        flags=[flag],
        source=scorer.source,
        latency_ms=(time.perf_counter() - started) * 1000,
        missing=True,
        message=message[:4096],
    )
