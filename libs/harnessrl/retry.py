"""Which errors are worth retrying, and how long to wait between tries.

Everything else propagates: a retry of an error that will recur only hides it (STYLE.md §8).
The classifier is the single place that decides; it is tested in tests/unit/test_retry.py.
"""

from __future__ import annotations

import asyncio
import errno
import random
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


class RetryableError(Exception):
    """Raise (or subclass) to say: this failure is transient, try again later."""


class PermanentError(Exception):
    """Raise (or subclass) to say: this will fail again; do not retry."""


_RETRYABLE_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.EAGAIN,
    }
)
# aiokafka marks connection-level errors `retriable`; these broker answers are transient too.
_KAFKA_TRANSIENT = frozenset(
    {
        "KafkaTimeoutError",
        "RequestTimedOutError",
        "NotLeaderForPartitionError",
        "LeaderNotAvailableError",
        "UnknownTopicOrPartitionError",
        "NotEnoughReplicasError",
        "NotEnoughReplicasAfterAppendError",
        "GroupCoordinatorNotAvailableError",
        "NotCoordinatorForGroupError",
        "GroupLoadInProgressError",
        "BrokerNotAvailableError",
    }
)
_GRPC_TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "ABORTED"})
_HTTP_TRANSIENT = frozenset({408, 425, 429, 502, 503, 504})


def is_retryable(exc: BaseException) -> bool:
    """True when `exc` is a transient failure that a later identical attempt may not hit.

    Recognises the project's own markers, connection and timeout errors, aiokafka errors it
    flags (or that are known to be transient), gRPC status codes UNAVAILABLE,
    DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED and ABORTED, and httpx transport errors and
    408/425/429/502/503/504 responses. CancelledError is never retryable.
    """
    if isinstance(exc, asyncio.CancelledError | PermanentError):
        return False
    if isinstance(exc, RetryableError | ConnectionError | TimeoutError):
        return True
    if isinstance(exc, OSError):
        return exc.errno in _RETRYABLE_ERRNOS
    # A library's errors can only occur once it is imported: look, never import.
    kafka_errors = sys.modules.get("aiokafka.errors")
    if kafka_errors is not None and isinstance(exc, kafka_errors.KafkaError):
        return bool(getattr(exc, "retriable", False)) or type(exc).__name__ in _KAFKA_TRANSIENT
    grpc = sys.modules.get("grpc")
    if grpc is not None and isinstance(exc, grpc.RpcError):
        code = getattr(exc, "code", None)
        return callable(code) and getattr(code(), "name", "") in _GRPC_TRANSIENT
    httpx = sys.modules.get("httpx")
    if httpx is not None and isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in _HTTP_TRANSIENT
    return httpx is not None and isinstance(exc, httpx.TransportError)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter: delay n is uniform in [0, min(max, first*2^n)]."""

    first_s: float = 0.1
    max_s: float = 5.0
    jitter: bool = True

    def delays(self) -> Iterator[float]:
        """An endless sequence of delays, in seconds."""
        ceiling = self.first_s
        while True:
            yield random.uniform(0, ceiling) if self.jitter else ceiling
            ceiling = min(self.max_s, ceiling * 2)


async def retry(
    attempt: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    max_attempts: int,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Await `attempt()` until it succeeds, retrying only retryable errors.

    Raises the last error when it is not retryable or after `max_attempts` attempts.
    `on_retry(attempt_number, error)` is called before each wait.
    """
    delays = backoff.delays()
    for number in range(1, max_attempts + 1):
        try:
            return await attempt()
        except Exception as err:
            if number == max_attempts or not is_retryable(err):
                raise
            if on_retry is not None:
                on_retry(number, err)
            await asyncio.sleep(next(delays))
    raise AssertionError("unreachable: the loop returns or raises")
