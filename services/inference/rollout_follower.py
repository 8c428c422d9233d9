"""Following a canary rollout: the versions an inference replica serves, folded from hrl.policy.

With `production.canary.enabled` a replica does not simply load each newer version
(follower.PolicyFollower). It folds hrl.policy's PolicyVersion and RolloutDecision events
with harnessrl.rollout.RolloutState, as every service does, and after each event makes the
replica serve what the rollout needs:

- a replica serving LoRA adapters keeps loaded `Rollout.serving()` (stable, candidate,
  current): it loads the missing ones; a version the rollout stops needing (a stable
  replaced by a promotion, a rolled-back candidate) stays loaded `keep_s` longer, so the
  sessions assigned to it end on it, then is unloaded (`expire`, called periodically); a
  loader that keeps spare adapters (vLLM's keep_adapters) may leave the newest others
  loaded, never a retired one (rolled back, or descending from a version that was). A
  retired version is never loaded.
- a replica serving full weights serves the one version its `follow` label names (newest:
  the current version; stable; candidate: the candidate, else the current version).

After every change it reports PolicyLoaded(ok=true) with every version served now and the
model name that asks for each (`serving`). A version that fails verification is reported
PolicyLoaded(ok=false) and never tried again by this process; one the trainer does not
hold is reported ok=false with "version gone: ..." too (once), so the canary judge can roll
a candidate back instead of waiting for a load that cannot happen, and is tried again at
the next reconcile (a restarted trainer serves the stable and candidate again). Which kind a replica
serves is known once it pulled a version (the loader's `adapters`); until then it loads as
for adapters, the `follow` target first, and any other version only if it is an adapter
(NotAnAdapter otherwise: nothing changes, and the replica now knows it serves full weights).
Transient failures propagate: the consumer retries the event, and the fold is replay-safe
(RolloutState's own: hrl.policy's history read at start, then the consumer's records, each
folded as every other service folds it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter

from harnessrl.bus import Context
from harnessrl.logs import get_logger
from harnessrl.retry import is_retryable
from harnessrl.rollout import Rollout, RolloutState
from harnessrl.services.inference.config import Follow
from harnessrl.services.inference.follower import NotAnAdapter, VersionGone, WeightLoader
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


class RolloutLoader(WeightLoader, Protocol):
    """A weight loader that can serve several versions at once (LoRA adapters)."""

    @property
    def served(self) -> Mapping[int, str]:
        """Every version served now, with the model name a request must carry for it."""

    @property
    def adapters(self) -> bool | None:
        """True: serves LoRA adapters, several at once; False: full weights, one version;
        None: not known until a version was loaded."""

    @property
    def keep(self) -> int:
        """Most adapters it keeps loaded when the rollout needs fewer (0: exactly those)."""

    async def add(self, address: str, version: int, *, adapter_only: bool = False) -> None:
        """Serve `version` from now on: an adapter beside the versions served, full weights
        in place of them. Raises as WeightLoader.load does, and NotAnAdapter for full
        weights with `adapter_only`; nothing changes on failure."""

    async def remove(self, version: int) -> None:
        """Stop serving the adapter `version` (idempotent); requests it is serving finish."""


def target(state: Rollout, follow: Follow) -> int | None:
    """The version a full-weight replica labelled `follow` serves in `state`."""
    if follow == "stable":
        return state.stable
    if follow == "candidate" and state.candidate is not None:
        return state.candidate
    return state.current()


class RolloutFollower:
    """Consumer handlers for hrl.policy on one replica during canary rollouts."""

    def __init__(
        self,
        loader: RolloutLoader,
        *,
        engine_name: str,
        follow: Follow,
        registry: CollectorRegistry,
        keep_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._loader = loader
        self._keep_s = keep_s
        self._clock = clock
        self._released: dict[int, float] = {}
        """Versions the rollout stopped needing while loaded -> when (the clock's seconds)."""
        self._name = engine_name
        self._follow = follow
        self.rollout = RolloutState()
        self._addresses: dict[int, str] = {}
        self._failed: dict[int, str] = {}
        """Versions refused (verification, another base, a bad fit), with why: never tried
        again."""
        self._reported: dict[int, str] | None = None
        """What the last PolicyLoaded(ok) said the replica serves."""
        self._gone: set[int] = set()
        """Versions reported gone: tried again, reported again only once loaded."""
        self._lock = asyncio.Lock()
        self._loads = Counter(
            "harnessrl_engine_rollout_loads",
            "Weight loads of a canary rollout's versions by outcome.",
            ["outcome"],
            registry=registry,
        )

    def fold(self, event: pb.PolicyVersion | pb.RolloutDecision) -> None:
        """Fold one hrl.policy event into the rollout (idempotent; in topic order)."""
        if isinstance(event, pb.PolicyVersion):
            self._addresses[int(event.version)] = event.weightsync_address
            self.rollout.announced(event)
            return
        reason = self.rollout.decided(event)  # replay-safe: RolloutState dedupes itself
        if reason is not None:
            log.info("rollout decision refused", decision_id=event.decision_id, reason=reason)

    async def on_version(self, event: pb.PolicyVersion, ctx: Context) -> None:
        """The consumer's handler of PolicyVersion: fold, reconcile, publish what changed."""
        self.fold(event)
        await self.reconcile(ctx.publish)

    async def on_decision(self, event: pb.RolloutDecision, ctx: Context) -> None:
        """The consumer's handler of RolloutDecision: fold, reconcile, publish what changed."""
        self.fold(event)
        await self.reconcile(ctx.publish)

    async def reconcile(self, report: Callable[[pb.PolicyLoaded], object]) -> None:
        """Make the replica serve what the rollout needs, handing `report` each PolicyLoaded
        as soon as it is true (one per load tried, one after the removals: a removal waits
        for its version's requests, and the gateways need not wait for it to hear of a
        load). Raises the loader's transient errors."""
        async with self._lock:
            state = self.rollout.state
            if state.stable is None:
                return
            full = target(state, self._follow)
            for version in self._wanted(state):
                if self._loader.adapters is False and version != full:
                    continue
                if version in self._loader.served or version in self._failed:
                    continue
                loaded = await self._load(version, adapter_only=version != full)
                if loaded is not None:
                    self._told(loaded, report)
            if self._loader.adapters:
                await self._unload_surplus(state)
            if self._loader.served and self._reported != dict(self._loader.served):
                # Unloads, or what the replica served before it first heard of the rollout
                # (its initial weights, version 0): the gateways learn of it here.
                self._told(self._report(max(self._loader.served)), report)

    def _told(self, loaded: pb.PolicyLoaded, report: Callable[[pb.PolicyLoaded], object]) -> None:
        if loaded.ok:
            self._reported = {s.version: s.model for s in loaded.serving}
        report(loaded)

    async def expire(self, report: Callable[[pb.PolicyLoaded], object]) -> None:
        """Unload the versions kept past `keep_s` (the service calls it periodically)."""
        await self.reconcile(report)

    def _wanted(self, state: Rollout) -> list[int]:
        """The versions to serve, the full-weight target first."""
        first = target(state, self._follow)
        rest = sorted(state.serving() - {first}, reverse=True)
        wanted = [v for v in (first, *rest) if v is not None]
        return [v for v in wanted if not state.retired(v)]

    async def _unload_surplus(self, state: Rollout) -> bool:
        """Unload what the rollout no longer needs; whether anything was unloaded."""
        wanted = set(self._wanted(state))
        now = self._clock()
        for version in wanted:
            self._released.pop(version, None)
        for version in set(self._loader.served) - wanted:
            self._released.setdefault(version, now)
        kept = {v for v, since in self._released.items() if now - since < self._keep_s}
        wanted |= kept & set(self._loader.served)
        surplus = sorted(set(self._loader.served) - wanted, reverse=True)
        room = max(0, self._loader.keep - len(wanted & set(self._loader.served)))
        spare = [v for v in surplus if not state.retired(v)][:room]
        unloaded = False
        for version in surplus:
            if version in spare or len(self._loader.served) < 2:
                continue
            await self._loader.remove(version)
            self._released.pop(version, None)
            log.info("policy version unloaded", version=version, retired=state.retired(version))
            unloaded = True
        return unloaded

    async def _load(self, version: int, *, adapter_only: bool) -> pb.PolicyLoaded | None:
        """Load `version`; its report, or None when it is full weights not to load."""
        started = time.monotonic()
        address = self._addresses[version]  # wanted versions are announced ones
        try:
            await self._loader.add(address, version, adapter_only=adapter_only)
        except NotAnAdapter:
            return None  # a full-weight replica: only its `follow` target is loaded
        except VersionGone as gone:
            self._loads.labels("skipped").inc()
            if version in self._gone:
                return None  # reported before; tried again at the next reconcile
            self._gone.add(version)
            log.warning("policy version not held by the trainer", version=version)
            return self._refused(version, f"version gone: {gone}", started)
        except Exception as err:
            if is_retryable(err):
                raise  # the consumer retries: the trainer or the engine may be restarting
            self._loads.labels("failed").inc()
            self._failed[version] = f"{type(err).__name__}: {err}"[:2000]
            log.error("policy version refused", version=version, error=str(err))
            return self._refused(version, self._failed[version], started)
        self._loads.labels("ok").inc()
        self._gone.discard(version)
        report = self._report(version, load_ms=(time.monotonic() - started) * 1000)
        log.info(
            "policy version loaded",
            version=version,
            serving=sorted(self._loader.served),
            load_ms=round(report.load_ms, 1),
        )
        return report

    def _refused(self, version: int, error: str, started: float) -> pb.PolicyLoaded:
        return pb.PolicyLoaded(
            version=version,
            engine=self._name,
            ok=False,
            error=error,
            load_ms=(time.monotonic() - started) * 1000,
            serving=self._serving(),
        )

    def _report(self, version: int, load_ms: float = 0.0) -> pb.PolicyLoaded:
        return pb.PolicyLoaded(
            version=version,
            engine=self._name,
            ok=True,
            load_ms=load_ms,
            served_model=self._loader.served.get(version, ""),
            serving=self._serving(),
        )

    def _serving(self) -> list[pb.ServedVersion]:
        served = self._loader.served
        return [pb.ServedVersion(version=v, model=served[v]) for v in sorted(served)]
