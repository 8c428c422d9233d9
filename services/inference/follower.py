"""Following the trainer: each PolicyVersion on hrl.policy becomes the weights served.

For every announced version newer than the one served, the follower has its loader pull it
over WeightSync and swap it in, and publishes PolicyLoaded. The loaders: the project's
engine (`EngineLoader`: pull, shared memory when the trainer offers it on this host, then
swap between requests; a LoRA version is applied on the base), and a `vllm serve` driven by
`harnessrl vllm-sync`, with full weights (services/inference/vllm_server.py) or LoRA
adapters (services/inference/vllm_lora.py). A pull that fails verification (a corrupt
chunk, a checksum mismatch) or a state dict that does not fit the model is refused: the
engine keeps serving its current version, the failure is logged, counted, and reported as
PolicyLoaded(ok=false). A version the trainer no longer holds (a newer one superseded it
while this replica was away) is skipped quietly: the newer announcement follows. Transient
failures (the trainer or the engine unreachable) propagate, so the consumer retries.

During a canary rollout (production.canary.enabled) rollout_follower.py follows hrl.policy
instead, with the same loaders: they also serve several adapter versions at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter

from harnessrl.bus import Context
from harnessrl.logs import get_logger
from harnessrl.retry import is_retryable
from harnessrl.v1 import events_pb2 as pb
from harnessrl.weights.errors import WeightSyncError

if TYPE_CHECKING:  # torch only where the project's engine runs
    from harnessrl.services.inference.engine import Engine
    from harnessrl.v1 import weights_pb2 as weights_pb
    from harnessrl.weights import FetchResult

log = get_logger(__name__)

Pull = Callable[[str, int], Awaitable["FetchResult"]]
"""(WeightSync address, version) -> the verified version (manifest and tensors). Raises
VersionGone when the trainer no longer holds the version, another exception when the
transfer or its verification fails."""


class VersionGone(Exception):
    """The trainer no longer serves the requested version."""


class NotAnAdapter(Exception):
    """The version asked for beside others is full weights: nothing was changed, and the
    loader now knows it serves full weights (rollout_follower.py)."""


def weightsync_puller(use_shm: bool) -> Pull:
    """A Pull over WeightSync: a client per call, NOT_FOUND raised as VersionGone."""

    async def pull(address: str, version: int) -> FetchResult:
        import grpc

        from harnessrl.weights import WeightSyncClient

        async with WeightSyncClient(address) as client:
            try:
                return await client.fetch(version, use_shm=use_shm)
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    raise VersionGone(err.details() or "not found") from err
                raise

    return pull


class WeightLoader(Protocol):
    """What a follower drives: an engine's served version, and loading a newer one."""

    @property
    def version(self) -> int:
        """The policy version the engine serves now (as far as the loader knows)."""

    @property
    def served_model(self) -> str:
        """The model name requests must carry to be served `version` ("": the engine's
        own name, whatever it serves)."""

    async def load(self, address: str, version: int) -> None:
        """Serve `version`, pulled from the WeightSync server at `address`, from now on.

        Raises VersionGone when the trainer no longer holds it, a retryable error
        (harnessrl.retry.is_retryable) when the trainer or the engine cannot be reached,
        and any other error when the version is refused: the engine then keeps serving its
        previous weights.
        """


class EngineLoader:
    """The project's own engine: pull the version, then swap it in between requests (`load`),
    or, during a canary rollout (rollout_follower.py), serve an adapter beside the versions
    served (`add`) and stop serving one (`remove`).

    A version that is a LoRA adapter is refused (WeightSyncError) when it was trained on
    another base than `base_model`, the directory the engine started from (compared by
    checksum, computed once), or when the engine no longer serves that base because a full
    version replaced it. `served_name` is the engine's model name: version v is asked for
    as `<served_name>@v<v>` (api.py).
    """

    def __init__(
        self,
        engine: Engine,
        pull: Pull,
        base_model: Path | None = None,
        served_name: str = "",
    ) -> None:
        self._engine = engine
        self._pull = pull
        self._base_model = base_model
        self._base_checksums: dict[str, str] = {}
        self._base_replaced = False
        self._served_name = served_name
        self._adapters: bool | None = None

    @property
    def version(self) -> int:
        return self._engine.version

    @property
    def served_model(self) -> str:
        return ""  # the engine names the version in each answer's x-policy-version

    @property
    def served(self) -> dict[int, str]:
        """Each version the engine serves, with the model name that asks for it."""
        name = self._served_name
        return {v: f"{name}@v{v}" if name else "" for v in self._engine.versions}

    @property
    def adapters(self) -> bool | None:
        return self._adapters

    @property
    def keep(self) -> int:
        return 0  # the engine holds exactly what the rollout needs

    async def load(self, address: str, version: int) -> None:
        await self._install(address, version, beside=False)

    async def add(self, address: str, version: int, *, adapter_only: bool = False) -> None:
        await self._install(address, version, beside=True, adapter_only=adapter_only)

    async def remove(self, version: int) -> None:
        await self._engine.remove(version)

    async def _install(
        self, address: str, version: int, *, beside: bool, adapter_only: bool = False
    ) -> None:
        result = await self._pull(address, version)
        manifest = result.manifest
        if not manifest.HasField("adapter") and adapter_only:
            self._adapters = False
            raise NotAnAdapter(f"version {version}: full weights, asked for as an adapter")
        if not manifest.HasField("adapter"):
            await self._engine.swap(version, result.state_dict)
            self._base_replaced = True
            self._adapters = False
            return
        await self._check_base(manifest)
        if beside:
            await self._engine.add(version, result.state_dict, manifest.adapter)
        else:
            await self._engine.swap(version, result.state_dict, manifest.adapter)
        self._adapters = True

    async def _check_base(self, manifest: weights_pb.WeightManifest) -> None:
        from harnessrl.weights.adapter import base_checksum, check_base
        from harnessrl.weights.checksums import algorithm_of

        what = f"version {manifest.version}"
        if self._base_replaced:
            raise WeightSyncError(
                f"{what}: a LoRA adapter, but this engine serves the full weights of an "
                "earlier version, not the base model it applies to"
            )
        expected = manifest.adapter.base_checksum
        if not expected or self._base_model is None:
            return  # nothing to compare against
        algorithm = algorithm_of(expected, f"{what} base_checksum")
        if algorithm not in self._base_checksums:
            self._base_checksums[algorithm] = await asyncio.to_thread(
                base_checksum, self._base_model, algorithm
            )
        check_base(manifest.adapter, self._base_checksums[algorithm], what)


class PolicyFollower:
    """Consumer handler for hrl.policy on one inference replica (idempotent per version)."""

    def __init__(
        self, loader: WeightLoader, *, engine_name: str, registry: CollectorRegistry
    ) -> None:
        self._loader = loader
        self._name = engine_name
        self._loads = Counter(
            "harnessrl_engine_weight_loads",
            "Weight loads by outcome.",
            ["outcome"],
            registry=registry,
        )

    async def on_version(self, event: pb.PolicyVersion, ctx: Context) -> None:
        """The consumer's handler of PolicyVersion: apply it, publish what was loaded."""
        loaded = await self.apply(event)
        if loaded is not None:
            ctx.publish(loaded)

    async def apply(self, event: pb.PolicyVersion) -> pb.PolicyLoaded | None:
        """Load `event`'s version unless the engine already serves it or a newer one.

        Returns the PolicyLoaded to publish (ok or refused), or None when nothing was
        loaded (already served, or the trainer no longer holds the version). Raises the
        loader's transient errors, for the caller to retry.
        """
        if event.version <= self._loader.version:
            return None  # already served (a replay, or an older announcement)
        started = time.monotonic()
        try:
            await self._loader.load(event.weightsync_address, event.version)
        except VersionGone as gone:
            self._loads.labels("skipped").inc()
            log.info(
                "policy version no longer held by the trainer; skipped",
                version=event.version,
                reason=str(gone),
            )
            return None
        except Exception as err:
            if is_retryable(err):
                raise  # the consumer retries: the trainer or the engine may be restarting
            self._loads.labels("failed").inc()
            log.error(
                "policy version refused; still serving the previous one",
                version=event.version,
                serving=self._loader.version,
                error=str(err),
            )
            return pb.PolicyLoaded(
                version=event.version,
                engine=self._name,
                ok=False,
                error=f"{type(err).__name__}: {err}"[:2000],
                load_ms=(time.monotonic() - started) * 1000,
            )
        load_ms = (time.monotonic() - started) * 1000
        self._loads.labels("ok").inc()
        log.info("policy version loaded", version=event.version, load_ms=round(load_ms, 1))
        return pb.PolicyLoaded(
            version=event.version,
            engine=self._name,
            ok=True,
            load_ms=load_ms,
            served_model=self._loader.served_model,
        )
