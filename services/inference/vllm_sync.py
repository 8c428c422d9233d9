"""`harnessrl vllm-sync`: the policy follower for a `vllm serve`.

The project's own engine follows hrl.policy in-process; vLLM cannot, so this small service
does it for one vLLM server. It consumes hrl.policy in a consumer group of its own, and for
each PolicyVersion newer than what vLLM serves it pauses vLLM, has every worker stage the
version over WeightSync, commits, resumes (harnessrl.weights.vllm_worker), and publishes
PolicyLoaded(version, engine, ok, error, load_ms) exactly as the engine's follower does
(the same PolicyFollower, with services/inference/vllm_server.py as its loader). `engine`
is the URL the gateway has for this vLLM: vLLM sends no x-policy-version header, so the
gateway stamps its calls with the version of this engine's last PolicyLoaded(ok=true).

With `vllm_sync.lora_name` set (the trainer trains LoRA adapters) the loader is
services/inference/vllm_lora.py instead: each version becomes an adapter loaded through
vLLM's runtime LoRA API under a versioned name, which its PolicyLoaded carries
(`served_model`) so the gateway asks vLLM for exactly that version; no pause is needed.

It also asks vLLM which version it serves (collective_rpc harnessrl_version; with adapters,
the newest one /v1/models lists) at start and every `check_interval_s`: a vLLM that
restarted on its initial weights, or that was down when a version was announced, gets the
newest announced version (or, if vLLM refused that one, the newest it had loaded). While
vLLM cannot be reached it retries with backoff, and /healthz reports `vllm_reachable:
false`. The newest announcements are read back from hrl.policy at start, so a restarted
vllm-sync knows them too.

With `production.canary.enabled` it follows the rollout instead (rollout_follower.py): it
folds every PolicyVersion and RolloutDecision (read back at start, then consumed), and after
each event, and at every check, has vLLM serve what the rollout needs: with adapters, the
stable, candidate and current versions (the stable and candidate never unloaded; a vLLM that
restarted gets them all back at the next check); with full weights, the version its
`follow` label names.

Tested against a stand-in vLLM HTTP server (tests/vllm_standin.py: /pause, /resume,
/collective_rpc running the real worker extension on stand-in workers; /v1/models and the
runtime LoRA endpoints reading the adapter directories written) with a real
WeightSync server and the embedded broker, because vLLM cannot run on the machines this
project is built on: nothing here has driven a real vLLM.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from typing import Any

from harnessrl import events
from harnessrl.bus import Consumer, Context
from harnessrl.bus.snapshot import read_to_end
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, is_retryable, retry
from harnessrl.runtime import Runtime
from harnessrl.service_bus import Handlers, ServiceBus, Subscription
from harnessrl.services.inference.config import VllmSyncConfig
from harnessrl.services.inference.follower import PolicyFollower, weightsync_puller
from harnessrl.services.inference.rollout_follower import RolloutFollower
from harnessrl.services.inference.vllm_lora import VllmLoraServer
from harnessrl.services.inference.vllm_server import VllmServer
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


class PolicyBook:
    """What vllm-sync remembers of hrl.policy to re-apply: the newest announced version, the
    newest this engine loaded, and the versions that will not load (refused, or gone)."""

    def __init__(self) -> None:
        self.latest: pb.PolicyVersion | None = None
        self.loaded: pb.PolicyVersion | None = None
        self.unloadable: set[int] = set()

    def announced(self, event: pb.PolicyVersion) -> None:
        if self.latest is None or event.version > self.latest.version:
            self.latest = event

    def outcome(self, version: int, ok: bool, event: pb.PolicyVersion | None = None) -> None:
        """Record that loading `version` succeeded, or will not succeed. `event` is its
        announcement, when known (else the newest announcement, if it is that version)."""
        if not ok:
            self.unloadable.add(version)
            return
        if event is None and self.latest is not None and self.latest.version == version:
            event = self.latest
        if event is not None and (self.loaded is None or version > self.loaded.version):
            self.loaded = event

    def target(self, served: int) -> pb.PolicyVersion | None:
        """The version to (re-)apply to an engine serving `served`, or None."""
        for event in (self.latest, self.loaded):
            if (
                event is not None
                and event.version > served
                and event.version not in self.unloadable
            ):
                return event
        return None


class VllmSyncService:
    """Follows hrl.policy for one `vllm serve`; see the module docstring."""

    def __init__(self, config: VllmSyncConfig, runtime: Runtime) -> None:
        section = config.vllm_sync
        if section.vllm_url is None:
            raise ValueError(
                "vllm_sync.vllm_url: required (the `vllm serve` root URL, e.g. "
                "http://vllm:8100; HARNESSRL_VLLM_SYNC__VLLM_URL or --vllm-url)"
            )
        self._config = config
        self._runtime = runtime
        self.engine_name = section.engine_name or section.vllm_url
        self.vllm: VllmServer | VllmLoraServer
        if section.lora_name is None:
            self.vllm = VllmServer(
                section.vllm_url,
                initial_version=section.initial_version,
                pause_mode=section.pause_mode,
                rpc_timeout_s=section.rpc_timeout_s,
            )
        else:
            self.vllm = VllmLoraServer(
                section.vllm_url,
                lora_name=section.lora_name,
                adapter_dir=section.adapter_dir,
                pull=weightsync_puller(use_shm=True),
                initial_version=section.initial_version,
                keep_adapters=section.keep_adapters,
                base_model=section.base_model,
                timeout_s=section.rpc_timeout_s,
            )
        self.book = PolicyBook()
        self.follower = PolicyFollower(
            self.vllm, engine_name=self.engine_name, registry=runtime.registry
        )
        self.rollout: RolloutFollower | None = None
        """Set with production.canary.enabled: follows the rollout, not the newest version."""
        if config.production.canary.enabled:
            self.rollout = RolloutFollower(
                self.vllm,
                engine_name=self.engine_name,
                follow=section.follow,
                registry=runtime.registry,
                keep_s=config.production.canary.keep_s,
            )
        self._lock = asyncio.Lock()  # one swap or check at a time
        self._stopping = asyncio.Event()
        self._bus = ServiceBus(config, runtime)
        self._tasks: list[asyncio.Task[None]] = []
        self._reachable = False
        self.ready = asyncio.Event()
        """Set once vLLM answered and hrl.policy is being followed."""

    async def run(self) -> None:
        async with AsyncExitStack() as stack:
            await self._bus.start(stack)
            # Every vLLM server must see every version: a consumer group of its own.
            group = f"harnessrl.vllm-sync.{self._config.instance}"
            handlers: Handlers = {pb.PolicyVersion: self._on_version}
            if self.rollout is not None:
                handlers = {
                    pb.PolicyVersion: self._on_rollout,
                    pb.RolloutDecision: self._on_rollout,
                }
            consumer = self._bus.consumer(Subscription(group, handlers))
            checked = asyncio.Event()
            watch = asyncio.create_task(self._watch(checked), name="vllm-watch")
            follow = asyncio.create_task(self._follow(consumer, checked), name="policy-follow")
            self._tasks = [watch, follow]

            async def stop_following() -> None:
                await consumer.stop()
                async with self._lock:  # a swap in progress finishes: vLLM is not left paused
                    watch.cancel()
                    if not self.ready.is_set():
                        follow.cancel()  # still rebuilding or waiting for vLLM
                await asyncio.gather(watch, follow, return_exceptions=True)

            stack.push_async_callback(stop_following)
            stopped = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait([stopped, watch, follow], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            for task in (watch, follow):
                if task.done() and not task.cancelled() and (error := task.exception()):
                    raise error

    async def stop(self) -> None:
        self._stopping.set()

    def health(self) -> dict[str, bool]:
        return {
            "producer": self._bus.healthy,
            "vllm_reachable": self._reachable,
            "following": bool(self._tasks) and not any(t.done() for t in self._tasks),
        }

    async def _follow(self, consumer: Consumer, checked: asyncio.Event) -> None:
        """Rebuild the book from hrl.policy, wait for vLLM's first answer, then consume."""
        await self._bus.create_topics([events.POLICY])
        await retry(self._rebuild, backoff=Backoff(0.5, 5.0), max_attempts=10**6)
        await checked.wait()
        async with self._lock:
            try:
                await self._catch_up()  # before consuming: a fresh group replays old versions
            except Exception as err:
                if not is_retryable(err):
                    raise
                log.warning("catching vLLM up failed; the next check retries", error=repr(err))
        self.ready.set()
        log.info(
            "following hrl.policy for vLLM",
            vllm=self.vllm.url,
            engine=self.engine_name,
            serving=self.vllm.version,
        )
        await consumer.run()

    async def _rebuild(self) -> None:
        async for _, event, _ in read_to_end(
            self._config.kafka, events.POLICY, client_id=f"{self._runtime.producer_name}/rebuild"
        ):
            if self.rollout is not None and isinstance(
                event, pb.PolicyVersion | pb.RolloutDecision
            ):
                self.rollout.fold(event)
            if isinstance(event, pb.PolicyVersion):
                self.book.announced(event)
            elif isinstance(event, pb.PolicyLoaded) and event.engine == self.engine_name:
                self.book.outcome(event.version, event.ok)

    async def _on_version(self, event: pb.PolicyVersion, ctx: Context) -> None:
        async with self._lock:  # announced and applied at once: the check never races it
            self.book.announced(event)
            loaded = await self._apply(event)
        if loaded is not None:
            ctx.publish(loaded)

    async def _on_rollout(self, event: pb.PolicyVersion | pb.RolloutDecision, ctx: Context) -> None:
        rollout = self.rollout
        if rollout is None:  # subscribed only with a rollout follower
            return
        async with self._lock:
            rollout.fold(event)
            await rollout.reconcile(ctx.publish)

    async def _apply(self, event: pb.PolicyVersion) -> pb.PolicyLoaded | None:
        """The follower's apply, remembered in the book. Call with the lock held."""
        loaded = await self.follower.apply(event)
        if loaded is not None:
            self.book.outcome(loaded.version, loaded.ok, event)
        elif self.vllm.version < event.version:  # the trainer no longer holds it
            self.book.outcome(event.version, ok=False)
        return loaded

    async def _catch_up(self) -> None:
        """Apply what the book says vLLM lacks (nothing when it serves the newest); during
        a canary rollout, what the rollout needs."""
        if self.rollout is not None:
            await self.rollout.reconcile(self._publish)
            return
        target = self.book.target(self.vllm.version)
        if target is None:
            return
        log.info(
            "vLLM serves an older version than announced; applying the newest",
            serving=self.vllm.version,
            version=target.version,
        )
        loaded = await self._apply(target)
        if loaded is not None:
            self._bus.producer.publish(loaded).add_done_callback(_log_refused)

    async def _watch(self, checked: asyncio.Event) -> None:
        """Check vLLM's served version every check_interval_s, and catch it up once
        hrl.policy is followed. While vLLM cannot be reached, check with backoff instead."""
        interval = self._config.vllm_sync.check_interval_s
        delays = None
        while True:
            try:
                async with self._lock:
                    await self._check()
                    checked.set()
                    if self.ready.is_set():
                        await self._catch_up()
                delays, wait = None, interval
            except Exception as err:
                if not is_retryable(err):
                    raise
                if self._reachable:  # vLLM answered: the trainer failed, or vLLM mid-swap
                    wait = interval
                else:
                    delays = delays or Backoff(0.5, 5.0).delays()
                    wait = next(delays)
                log.warning("vLLM sync failed; retrying", vllm=self.vllm.url, error=repr(err))
            await asyncio.sleep(wait)

    async def _check(self) -> None:
        try:
            await self.vllm.check()
        except Exception:
            self._reachable = False
            raise
        if not self._reachable:
            log.info("vLLM reachable", vllm=self.vllm.url, serving=self.vllm.version)
        self._reachable = True

    def _publish(self, loaded: pb.PolicyLoaded) -> None:
        self._bus.producer.publish(loaded).add_done_callback(_log_refused)


def _log_refused(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("PolicyLoaded not published", error=repr(future.exception()))
