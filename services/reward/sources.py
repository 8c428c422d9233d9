"""Where a score comes from: a built-in, a Python entry point, or a remote gRPC service.

Every source is a `Scorer`: `score(episode)` returns what the reward returned (validated by
the caller with `to_score`) or raises. A source is chosen by the `reward.source` setting,
and the chosen name is carried in every RewardAssigned as its `source`.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from harnessrl.logs import get_logger
from harnessrl.retry import PermanentError, RetryableError
from harnessrl.services.reward.config import RewardSection
from harnessrl.services.reward.episode import Episode, Score
from harnessrl.telemetry import inject_headers

log = get_logger(__name__)

RewardFunction = Callable[[Episode], Any]
"""A reward: takes an Episode, returns a number, a Score or a mapping (value, components,
flags, message), or an awaitable of one. Sync functions run in a thread pool."""


class Scorer(Protocol):
    source: str

    async def score(self, episode: Episode) -> Any:
        """What the reward returned for `episode`; raises when it fails."""

    async def close(self) -> None:
        """Release connections and threads (idempotent)."""


class FunctionScorer:
    """A Python reward function, sync or async.

    A sync function runs in a thread; one that ignores its timeout keeps its thread until
    it returns (Python cannot kill a thread), so the pool is larger than the concurrency
    and `stuck` counts the calls still running past their timeout.
    """

    def __init__(self, source: str, function: RewardFunction, threads: int) -> None:
        self.source = source
        self._function = function
        self._is_async = _is_async(function)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="reward")
        self.running_in_threads = 0

    async def score(self, episode: Episode) -> Any:
        if self._is_async:
            return await self._function(episode)
        loop = asyncio.get_running_loop()
        returned = await loop.run_in_executor(self._pool, self._call, episode)
        if inspect.isawaitable(returned):
            return await returned
        return returned

    def _call(self, episode: Episode) -> Any:
        self.running_in_threads += 1
        try:
            return self._function(episode)
        finally:
            self.running_in_threads -= 1

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _is_async(function: Any) -> bool:
    call = type(function).__call__  # an object with an async __call__ is async too
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


class GrpcScorer:
    """A remote `Reward` service (protos/harnessrl/v1/reward.proto).

    UNAVAILABLE is transient (retried by the caller); any other status is final and makes
    the reward missing with the status and its details. The trace context travels in the
    call's metadata, so the remote scoring joins the episode's trace.
    """

    def __init__(self, address: str, *, tls: bool) -> None:
        import grpc

        from harnessrl.v1 import reward_pb2_grpc

        self.source = f"grpc:{address}"
        self.address = address
        credentials = grpc.ssl_channel_credentials() if tls else None
        self._channel = (
            grpc.aio.secure_channel(address, credentials)
            if credentials
            else grpc.aio.insecure_channel(address)
        )
        self._stub = reward_pb2_grpc.RewardStub(self._channel)

    async def score(self, episode: Episode) -> Score:
        import grpc

        from harnessrl.v1 import reward_pb2

        metadata = tuple((k, v.decode()) for k, v in inject_headers([]))
        try:
            response = await self._stub.Score(
                reward_pb2.ScoreRequest(episode=episode.event), metadata=metadata
            )
        except grpc.aio.AioRpcError as err:
            message = f"{self.source} answered {err.code().name}: {err.details()}"
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                raise RetryableError(message) from None
            raise PermanentError(message) from None
        return Score(
            value=response.value,
            components=dict(response.components),
            flags=tuple(response.flags),
            message=response.message,
        )

    async def close(self) -> None:
        await self._channel.close()


def _builtin(name: str, section: RewardSection) -> RewardFunction:
    if name == "answer":
        from harnessrl.services.reward.answer import AnswerReward

        return AnswerReward(section.answer)
    if name == "tests":
        from harnessrl.services.reward.patch_tests import TestsReward

        return TestsReward(section.tests)
    raise ValueError(f"reward.source: unknown builtin {name!r} (answer, tests)")


def load_entrypoint(spec: str, search_from: Path | None = None) -> RewardFunction:
    """The function named by "<module>:<function>" (a dotted attribute path after the
    colon), its module imported by `import_module`. Raises ValueError naming what is
    wrong."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"reward.source: entrypoint:{spec} is not entrypoint:<module>:<function>")
    target: Any = import_module(module_name, search_from)
    for part in attribute.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ValueError(f"reward.source: {module_name!r} has no {attribute!r}")
    if not callable(target):
        raise ValueError(f"reward.source: {spec} is not callable")
    function: RewardFunction = target
    return function


def import_module(name: str, search_from: Path | None) -> ModuleType:
    """Import an entry point's module by the one rule: from the Python path; failing that,
    when its top-level package is not on the path, from the nearest of `search_from` and
    its parents that holds that package (`<top>/` or `<top>.py`), which then joins the
    front of the path. So `examples.calculator.reward` imports from any working directory
    when the config file sits in the project or below it. Raises ValueError naming the
    field, the error and every directory looked in."""
    top = name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != top:  # the top-level package is there: the error is inside it
            raise ValueError(f"reward.source: cannot import {name!r}: {err}") from err
        missing = err
    except ImportError as err:
        raise ValueError(f"reward.source: cannot import {name!r}: {err}") from err
    found = _holder(top, search_from)
    if found is None:
        rule = _rule(top, search_from)
        raise ValueError(f"reward.source: cannot import {name!r}: {missing}; {rule}") from missing
    # Global, as any import is: the service loads its reward once, at start.
    sys.path.insert(0, str(found))
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ValueError(f"reward.source: cannot import {name!r} from {found}: {err}") from err


def _holder(top: str, search_from: Path | None) -> Path | None:
    """The nearest of `search_from` and its parents holding package or module `top`."""
    if search_from is None:
        return None
    start = search_from.resolve()
    for directory in (start, *start.parents):
        if (directory / top).is_dir() or (directory / f"{top}.py").is_file():
            return directory
    return None


def _rule(top: str, search_from: Path | None) -> str:
    if search_from is None:
        return (
            "an entry point's module is imported from the Python path, else from the config "
            "file's directory (reward.entrypoint_dir) or its nearest parent that holds it, "
            "and neither is set"
        )
    return (
        "an entry point's module is imported from the Python path, else from the config "
        f"file's directory (reward.entrypoint_dir) or its nearest parent that holds it: "
        f"none of {search_from.resolve()} and its parents holds {top}/ or {top}.py"
    )


def make_scorer(section: RewardSection) -> Scorer:
    """The scorer `section.source` names; ValueError (naming the field) when it cannot be
    made."""
    kind, _, rest = section.source.partition(":")
    threads = section.concurrency * 2
    if kind == "builtin":
        return FunctionScorer(section.source, _builtin(rest, section), threads)
    if kind == "entrypoint":
        function = load_entrypoint(rest, section.entrypoint_dir)
        return FunctionScorer(section.source, function, threads)
    if kind == "grpc":
        host, _, port = rest.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"reward.source: grpc:{rest} is not grpc:<host>:<port>")
        return GrpcScorer(rest, tls=section.grpc_tls)
    raise ValueError(f"reward.source: unknown kind {kind!r}")
