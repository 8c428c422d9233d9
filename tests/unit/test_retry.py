"""The retry classifier and the retry loop."""

from __future__ import annotations

import asyncio
import errno

import grpc
import httpx
import pytest
from aiokafka import errors as kafka_errors

from harnessrl.retry import Backoff, PermanentError, RetryableError, is_retryable, retry


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def _http_status(status: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://x")
    return httpx.HTTPStatusError(
        "x", request=request, response=httpx.Response(status, request=request)
    )


@pytest.mark.parametrize(
    "error",
    [
        RetryableError("busy"),
        ConnectionResetError(),
        TimeoutError(),
        OSError(errno.ECONNREFUSED, "refused"),
        kafka_errors.KafkaConnectionError(),
        kafka_errors.NodeNotReadyError(),
        kafka_errors.KafkaTimeoutError(),
        kafka_errors.RequestTimedOutError(),
        kafka_errors.NotLeaderForPartitionError(),
        _RpcError(grpc.StatusCode.UNAVAILABLE),
        _RpcError(grpc.StatusCode.DEADLINE_EXCEEDED),
        httpx.ConnectError("refused"),
        _http_status(503),
        _http_status(429),
    ],
)
def test_transient_errors_are_retryable(error: BaseException) -> None:
    assert is_retryable(error)


@pytest.mark.parametrize(
    "error",
    [
        PermanentError("no"),
        ValueError("bad input"),
        KeyError("x"),
        OSError(errno.ENOSPC, "disk full"),
        kafka_errors.MessageSizeTooLargeError(),
        kafka_errors.TopicAuthorizationFailedError(),
        _RpcError(grpc.StatusCode.INVALID_ARGUMENT),
        _http_status(400),
        _http_status(500),
        asyncio.CancelledError(),
    ],
)
def test_other_errors_are_not_retryable(error: BaseException) -> None:
    assert not is_retryable(error)


async def test_retry_retries_only_retryable_errors() -> None:
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError
        return "ok"

    assert await retry(flaky, backoff=Backoff(0.001, 0.002), max_attempts=5) == "ok"
    assert len(calls) == 3

    async def broken() -> str:
        calls.append(1)
        raise ValueError("bad")

    calls.clear()
    with pytest.raises(ValueError, match="bad"):
        await retry(broken, backoff=Backoff(0.001, 0.002), max_attempts=5)
    assert len(calls) == 1


async def test_retry_gives_up_after_max_attempts() -> None:
    async def down() -> None:
        raise ConnectionRefusedError

    with pytest.raises(ConnectionRefusedError):
        await retry(down, backoff=Backoff(0.001, 0.002), max_attempts=3)


def test_backoff_doubles_up_to_the_cap() -> None:
    delays = Backoff(0.1, 0.5, jitter=False).delays()
    assert [next(delays) for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
