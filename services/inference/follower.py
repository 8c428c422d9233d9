"""Following the trainer: each PolicyVersion on hrl.policy becomes the weights served.

For every announced version newer than the one served, the follower pulls it over
WeightSync (shared memory when the trainer offers it on this host), has the engine swap it
in between requests, and publishes PolicyLoaded. A pull that fails verification (a corrupt
chunk, a checksum mismatch) or a state dict that does not fit the model is refused: the
engine keeps serving its current version, the failure is logged, counted, and reported as
PolicyLoaded(ok=false). A version the trainer no longer holds (a newer one superseded it
while this replica was away) is skipped quietly: the newer announcement follows.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import torch
from prometheus_client import CollectorRegistry, Counter

from harnessrl.bus import Context, Record
from harnessrl.logs import get_logger
from harnessrl.services.inference.engine import Engine
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

Pull = Callable[[str, int], Awaitable[dict[str, torch.Tensor]]]
"""(WeightSync address, version) -> state dict. Raises VersionGone when the trainer no
longer holds the version, another exception when the transfer or its verification fails."""


class VersionGone(Exception):
    """The trainer no longer serves the requested version."""


class PolicyFollower:
    """Consumer handler for hrl.policy on one inference replica (idempotent per version)."""

    def __init__(
        self, engine: Engine, pull: Pull, *, engine_name: str, registry: CollectorRegistry
    ) -> None:
        self._engine = engine
        self._pull = pull
        self._name = engine_name
        self._loads = Counter(
            "harnessrl_engine_weight_loads",
            "Weight loads by outcome.",
            ["outcome"],
            registry=registry,
        )

    async def handle(self, record: Record, ctx: Context) -> None:
        if record.kind != "policy_version":
            return
        event: pb.PolicyVersion = record.event  # type: ignore[assignment]  # kind says so
        if event.version <= self._engine.version:
            return  # already served (a replay, or an older announcement)
        started = time.monotonic()
        try:
            state = await self._pull(event.weightsync_address, event.version)
            await self._engine.swap(event.version, state)
        except VersionGone as gone:
            self._loads.labels("skipped").inc()
            log.info(
                "policy version no longer held by the trainer; skipped",
                version=event.version,
                reason=str(gone),
            )
            return
        except Exception as err:
            if _transient(err):
                raise  # the consumer retries: the trainer may be restarting
            self._loads.labels("failed").inc()
            log.error(
                "policy version refused; still serving the previous one",
                version=event.version,
                serving=self._engine.version,
                error=str(err),
            )
            ctx.publish(
                pb.PolicyLoaded(
                    version=event.version,
                    engine=self._name,
                    ok=False,
                    error=f"{type(err).__name__}: {err}"[:2000],
                    load_ms=(time.monotonic() - started) * 1000,
                )
            )
            return
        load_ms = (time.monotonic() - started) * 1000
        self._loads.labels("ok").inc()
        log.info("policy version loaded", version=event.version, load_ms=round(load_ms, 1))
        ctx.publish(
            pb.PolicyLoaded(version=event.version, engine=self._name, ok=True, load_ms=load_ms)
        )


def _transient(err: BaseException) -> bool:
    from harnessrl.retry import is_retryable

    return is_retryable(err)
