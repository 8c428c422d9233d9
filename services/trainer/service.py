"""`harnessrl trainer`: GroupSamples in, policy versions out.

Groups accumulate into batches (batching.py); each batch is one optimiser step
(policy.py) run in a worker thread, so the event loop keeps the Kafka session and the
WeightSync server alive. After a step the new weights are served over WeightSync and
announced as PolicyVersion; in sync mode the gateways are paused around the swap until the
engines report PolicyLoaded. A GroupSamples record stays uncommitted until a checkpoint
holds the step that trained it: a crash resumes from the newest checkpoint, the records
after it are re-delivered, and the delivery ledger stored in the checkpoint (ledger.py)
skips what its weights hold — no sample is trained twice, none is skipped.

Under `production.canary` the trainer follows the rollout on hrl.policy (rollout_watch.py,
which states the rule for training under a canary): the stable and candidate versions stay
servable (protected in WeightSync, archived on disk), samples of retired versions are
dropped as `rolled_back`, and after a rollback, between two steps, the weights rewind to the
stable version's with a fresh optimiser, recorded in the step journal and checkpointed at
once (a trainer that restarts on retired weights rewinds again before serving anything).
Every PolicyVersion says which version's weights its step started from (`base`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

from opentelemetry.trace import Link, SpanContext, TraceFlags

from harnessrl import events
from harnessrl.bus import Context, Hold
from harnessrl.bus.snapshot import read_to_end
from harnessrl.logs import get_logger
from harnessrl.retry import PermanentError
from harnessrl.runtime import Runtime
from harnessrl.service_bus import Consuming, EventHandler, ServiceBus, Subscription
from harnessrl.services.trainer.archive import WEIGHTS, VersionArchive
from harnessrl.services.trainer.checkpoint import Checkpoints, TrainerState
from harnessrl.services.trainer.config import TrainerConfig
from harnessrl.services.trainer.delivery import DeliveryLedger
from harnessrl.services.trainer.distributed import World
from harnessrl.services.trainer.journal import StepJournal
from harnessrl.services.trainer.journal import lineage as journal_lineage
from harnessrl.services.trainer.journal import read as read_journal
from harnessrl.services.trainer.lora import adapter_spec
from harnessrl.services.trainer.metrics import TrainerMetrics
from harnessrl.services.trainer.policy import Policy
from harnessrl.services.trainer.rollout_watch import RolloutWatch
from harnessrl.services.trainer.swap import EngineWatch
from harnessrl.trust.batching import Batch, Batcher
from harnessrl.trust.session_samples import ESTIMATOR as SESSION_ESTIMATOR
from harnessrl.trust.step import StepStats
from harnessrl.v1 import events_pb2 as pb
from harnessrl.v1 import weights_pb2 as weights_pb
from harnessrl.weights import WeightSyncServer

log = get_logger(__name__)

GROUP = "harnessrl.trainer"


class TrainerService:
    def __init__(self, config: TrainerConfig, runtime: Runtime, world: World | None = None) -> None:
        self._config = config
        self._settings = config.trainer
        self._runtime = runtime
        self._world = world or World()
        self._policy: Policy | None = None
        self._checkpoints = Checkpoints(
            self._settings.checkpoint_dir, keep=self._settings.keep_checkpoints
        )
        self._watch: RolloutWatch | None = None
        """The canary rollout followed on hrl.policy (production.canary.enabled), else None."""
        if config.production.canary.enabled:
            archive = VersionArchive(self._settings.checkpoint_dir / "versions")
            self._watch = RolloutWatch(archive)
        self._batcher = Batcher(
            batch_groups=self._settings.batch_groups,
            batch_tokens=self._settings.batch_tokens,
            max_staleness=self._settings.max_staleness,
            max_session_staleness=self._settings.max_session_staleness,
            retired=None if self._watch is None else self._watch.retired,
            depth=None if self._watch is None else self._watch.depth,
        )
        self._ledger: DeliveryLedger[Hold] = DeliveryLedger(
            max_staleness=self._batcher.staleness.remembered
        )
        """What was offered, trained and checkpointed; holds records until a checkpoint."""
        self.step = 0
        self.version = 0
        """The newest version number this trainer used (versions never repeat)."""
        self._weights = 0
        """The version whose weights the policy holds: `version`, except after a rewind to
        the stable version (until the next step)."""
        self._base: int | None = None
        """The version `_weights` was trained from (PolicyVersion.base; None for 0)."""
        self._server: WeightSyncServer | None = None
        self._tokenizer: Any = None
        self._adapter: weights_pb.LoraAdapter | None = None
        """What every published version says of its adapters (trainer.lora), else None."""
        self._due = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._stopping = asyncio.Event()
        self._bus = ServiceBus(config, runtime)
        self._journal: StepJournal | None = None
        self._training: asyncio.Task[None] | None = None
        self._tracer = runtime.tracer
        self.metrics = TrainerMetrics(runtime.registry)
        self.ready = asyncio.Event()
        self.finished = asyncio.Event()
        self._dropped_since: Counter[str] = Counter()
        """Tokens dropped since the last announced version (PolicyVersion.tokens_dropped)."""
        self._deleted: set[str] = set()
        """Production sessions deleted (SessionDeleted on hrl.policy, read back at start):
        none of their samples is ever trained."""
        self._stepping: asyncio.Event = asyncio.Event()
        self._stepping.set()  # set while no step runs
        self._samples: Consuming | None = None
        """Stopped once max_steps are taken (and checkpointed); the trainer then only serves."""

    async def run(self) -> None:
        settings = self._settings
        async with AsyncExitStack() as stack:
            await self._bus.start(stack, topics=[events.SAMPLES, events.POLICY])
            self._policy = await asyncio.to_thread(self._load)
            watch = self._watch
            if watch is not None and self._policy.sharded:
                raise ValueError(
                    "production.canary.enabled: a trainer sharded with FSDP "
                    "(trainer.sharding.strategy=fsdp across ranks) cannot rewind after a "
                    "rollback; run one process or sharding.strategy=replicate"
                )
            self._journal = StepJournal(settings.checkpoint_dir, resumed_from=self.step)
            announced = await self._read_policy()
            await self._rewind_if_retired()  # resumed on weights a rollback retired?
            self._skip_lost_versions(announced)
            server = WeightSyncServer(settings.weightsync)
            self._server = server
            await server.start()
            stack.push_async_callback(server.stop)
            if watch is not None:
                await watch.restore(server)
            engines = EngineWatch(self._bus.producer, expected=settings.engines)
            # Every trainer instance follows every engine: a consumer group of its own.
            group = f"harnessrl.trainer.{self._config.instance}"
            handlers: dict[type[Any], EventHandler] = {
                **engines.handlers,
                pb.SessionDeleted: self._on_deleted,
            }
            if watch is not None:
                handlers[pb.PolicyVersion] = self._on_version
                handlers[pb.RolloutDecision] = self._on_decision
            self._bus.consume(stack, Subscription(group, handlers))
            if self._weights == self.version:  # else the stable version's, served already
                await self._announce(server, checkpoint="", base=self._base)
            if watch is not None:
                await watch.keep(server)
            samples = Subscription(GROUP, {pb.GroupSamples: self._on_samples})
            self._samples = self._bus.consume(stack, samples)
            training = asyncio.create_task(self._train(server, engines), name="train")
            self._training = training
            training.add_done_callback(_report_failure)
            stack.push_async_callback(self._finish, training)
            log.info(
                "trainer running",
                step=self.step,
                version=self.version,
                weightsync=self._address(server),
                world=self._world.size,
                device=str(self._policy.device),
            )
            self.ready.set()
            await self._stopping.wait()

    async def stop(self) -> None:
        self._stopping.set()

    def health(self) -> dict[str, bool]:
        training = self._training
        failed = (
            training is not None
            and training.done()
            and not training.cancelled()
            and training.exception() is not None
        )
        return {
            "producer": self._bus.healthy,
            "training": not failed,  # a dead training task: 503, so an orchestrator restarts
        }

    def _load(self) -> Policy:
        from transformers import AutoTokenizer

        policy = Policy.load(self._settings, self._world)
        self._tokenizer = AutoTokenizer.from_pretrained(self._settings.model)
        if self._settings.lora is not None:
            self._adapter = adapter_spec(
                self._settings.lora,
                self._settings.model,
                algorithm=self._settings.weightsync.checksum,
            )
        self._checkpoints.cleanup_partial()
        latest = self._checkpoints.latest()
        if latest is not None:
            state = self._checkpoints.load(
                latest, lambda path: policy.everywhere("load_tensors", path)
            )
            self.step, self.version = state.step, state.policy_version
            self._weights = int(state.extra.get("weights", self.version))
            base = state.extra.get("base", self.version - 1 if self.version else None)
            self._base = None if base is None else int(base)
            self._ledger.restore(state.ledger)
            log.info("resumed from checkpoint", path=str(latest), step=self.step)
        return policy

    async def _read_policy(self) -> int:
        """Read hrl.policy's history: deleted sessions, and (under a canary) the rollout.
        Returns the newest version announced (at least the checkpoint's)."""
        announced = self.version
        watch = self._watch
        async for _, event, _ in read_to_end(
            self._config.kafka,
            events.POLICY,
            client_id=f"{self._runtime.producer_name}/versions",
        ):
            if isinstance(event, pb.PolicyVersion):
                announced = max(announced, event.version)
                if watch is not None:
                    watch.announced(event)
            elif isinstance(event, pb.SessionDeleted):
                self._deleted.add(event.group_id)
            elif isinstance(event, pb.RolloutDecision) and watch is not None:
                watch.decided(event)
        return announced

    def _skip_lost_versions(self, announced: int) -> None:
        """Versions announced after the checkpoint we resumed from were lost with the crash;
        engines may serve one. The weights held are announced under a version above all of
        them (trained from the version they are), so every engine goes back to them."""
        if announced > self.version:
            log.warning(
                "versions after the checkpoint were lost; re-announcing its weights",
                checkpoint_version=self.version,
                weights=self._weights,
                lost_up_to=announced,
                version=announced + 1,
            )
            self.version = announced + 1
            self._base, self._weights = self._weights, self.version

    async def _on_samples(self, group: pb.GroupSamples, ctx: Context) -> None:
        assert self._policy is not None  # loaded before consuming
        _check_token_ids(group, self._policy.vocab_size)
        await self._room.wait()  # backpressure: at most two batches pending
        ledger = self._ledger
        if group.group_id in self._deleted:  # an app took the session back
            tokens = sum(sum(1 for m in s.loss_mask if m) for s in group.samples)
            self.metrics.tokens_dropped("deleted").inc(tokens)
            self._dropped_since["deleted"] += tokens
            ledger.offer(group.samples, taken=(), hold=ctx.hold)
            return
        taken = self._batcher.add(
            group, version=self._position(), trained=ledger.known, horizon=ledger.horizon
        )
        self._count_dropped()
        # Acknowledged only once a checkpoint holds its samples, also for a re-delivery of
        # samples not checkpointed yet: acknowledging it now would lose them in a crash.
        ledger.offer(group.samples, taken=taken, hold=ctx.hold)
        if self._batcher.due:
            self._due.set()
            if self._batcher.pending_groups >= 2 * self._settings.batch_groups:
                self._room.clear()

    def _position(self) -> int:
        """The version whose weights the trainer holds, for staleness: after a rewind, the
        stable version's (the batcher counts steps from it along the lineage)."""
        return self.version if self._watch is None else self._weights

    def _remembering(self) -> int:
        """The version the ledger measures what it must remember from. Under a canary the
        stable version serves most sessions for as long as a candidate is judged: the ledger
        keeps every trained sample of it (a copy is recognised, a fresh one is not below the
        horizon), however far the trainer's versions run ahead."""
        stable = None if self._watch is None else self._watch.state.stable
        if stable is None:
            return self.version
        return min(self.version, stable + self._batcher.staleness.remembered)

    def _count_dropped(self) -> None:
        for reason, count in self._batcher.dropped.items():
            self.metrics.samples_dropped(reason).inc(count)
        for reason, tokens in self._batcher.dropped_tokens.items():
            self.metrics.tokens_dropped(reason).inc(tokens)
            self._dropped_since[reason] += tokens
        self._batcher.dropped.clear()
        self._batcher.dropped_tokens.clear()

    async def _train(self, server: WeightSyncServer, engines: EngineWatch) -> None:
        settings = self._settings
        while settings.max_steps is None or self.step < settings.max_steps:
            await self._due.wait()
            self._due.clear()
            if self._stopping.is_set():
                return
            await self._rewind_if_retired()  # between steps, never during one
            if not self._batcher.due:
                continue
            batch = self._batcher.take(self._position())
            self._count_dropped()
            self._ledger.take((s.sample_id for s in batch.samples), stale=batch.stale)
            if self._batcher.pending_groups < 2 * settings.batch_groups:
                self._room.set()
            if not batch.samples:  # all of it grew stale while it waited
                if self._batcher.due:
                    self._due.set()
                continue
            self._stepping.clear()
            try:
                started_from = self._weights
                stats = await self._step(batch)
                self.step += 1
                self.version += 1
                self._base, self._weights = started_from, self.version
                self._ledger.trained(self._remembering())
                assert self._journal is not None
                self._journal.record(self.step, self.version, (s.sample_id for s in batch.samples))
            finally:
                self._stepping.set()
            checkpoint = ""
            if self.step % settings.checkpoint_every == 0 or self.step == settings.max_steps:
                checkpoint = await self._checkpoint()
            if settings.schedule == "sync":
                await engines.pause(self.version)
            await self._announce(server, checkpoint, base=self._base, sessions=_sessions_of(batch))
            if settings.schedule == "sync":
                await engines.wait_loaded(self.version, settings.load_timeout_s)
                await engines.resume(self.version)
            self.metrics.observe(stats, self.version)
            log.info(
                "step",
                step=self.step,
                version=self.version,
                loss=round(stats.loss, 6),
                clip_fraction=round(stats.clip_fraction, 4),
                grad_norm=round(stats.grad_norm, 4),
                mismatch=round(stats.mismatch, 6),
                samples=stats.samples,
                trained_tokens=stats.tokens,
                seconds=round(stats.seconds, 3),
            )
            if self._batcher.due:
                self._due.set()
        self.finished.set()
        if settings.at_max_steps == "exit":
            log.info("max_steps reached: stopping", step=self.step, version=self.version)
            self._stopping.set()
            return
        # The last version stays served (engines fetch it from this process) until stopped.
        assert self._samples is not None
        await self._samples.stop()
        log.info(
            "max_steps reached: serving the last version", step=self.step, version=self.version
        )

    async def _step(self, batch: Batch) -> StepStats:
        assert self._policy is not None
        policy = self._policy
        for sample in batch.samples:
            self.metrics.staleness.observe(self.version - sample.policy_version_min)
        links = [_link(g) for g in batch.groups if g.span_id and g.trace_id]
        with self._tracer.start_as_current_span("trainer.step", links=links) as span:
            span.set_attribute("harnessrl.step", self.step + 1)
            span.set_attribute("harnessrl.policy_version", self.version + 1)  # it produces
            span.set_attribute("harnessrl.groups", len(batch.groups))

            def run() -> StepStats:
                return policy.everywhere("step", batch.samples)  # type: ignore[no-any-return]

            stats = await asyncio.to_thread(run)
            span.set_attribute("harnessrl.loss", stats.loss)
        return stats

    async def _checkpoint(self, *, replace: bool = False) -> str:
        """Save a checkpoint of everything trained so far, then acknowledge its records
        (`replace`: one saved at this step already, before a rewind, is replaced)."""
        assert self._policy is not None
        policy = self._policy
        snapshot = self._ledger.snapshot(self._remembering())
        state = TrainerState(
            step=self.step,
            policy_version=self.version,
            ledger=snapshot.state,
            extra={"weights": self._weights, "base": self._base},
        )
        path = await asyncio.to_thread(
            self._checkpoints.save,
            lambda directory: policy.everywhere("save_tensors", directory),
            state,
            tokenizer=self._tokenizer,
            replace=replace,
        )
        for hold in self._ledger.checkpointed(snapshot):
            hold.release()
        log.info(
            "checkpoint saved",
            path=str(path),
            step=self.step,
            remembered=len(self._ledger),
            held=self._ledger.held,  # records a crash now would re-deliver
        )
        return path.resolve().as_uri()

    async def _on_version(self, event: pb.PolicyVersion, ctx: Context) -> None:
        assert self._watch is not None and self._server is not None
        self._watch.announced(event)
        await self._watch.keep(self._server)

    async def _on_decision(self, decision: pb.RolloutDecision, ctx: Context) -> None:
        """Fold a rollout decision; after a rollback that retires the weights held, the
        training loop rewinds before its next step (never during one)."""
        assert self._watch is not None and self._server is not None
        if self._watch.decided(decision):
            await self._watch.keep(self._server)
            if self._watch.retired(self._weights):
                self._due.set()

    async def _rewind_if_retired(self) -> None:
        """When a rollback retired the weights held: load the stable version's (archived
        when it became stable) with a fresh optimiser, journal it, and checkpoint at once,
        so a crash after it does not resume the retired line. Raises RuntimeError when the
        stable version is not archived."""
        if self._watch is None or not self._watch.retired(self._weights):
            return
        assert self._policy is not None
        stable = self._watch.state.stable
        assert stable is not None  # a rollback applied: versions were announced
        weights = self._watch.archive.path(stable) / WEIGHTS
        if not weights.is_file():
            raise RuntimeError(
                f"cannot rewind to stable version {stable} after a rollback: it is not "
                f"archived in {self._watch.archive.root} (it was stable before this trainer "
                "could archive it)"
            )
        retired = self._weights
        await asyncio.to_thread(self._policy.everywhere, "rewind", weights)
        self._weights = stable
        self._base = self._watch.state.bases.get(stable)
        assert self._journal is not None
        self._journal.rewind(self.step, stable)
        self.metrics.rewinds.inc()
        log.warning(
            "rolled back: weights rewound to the stable version",
            retired=retired,
            stable=stable,
            step=self.step,
            version=self.version,
        )
        await self._checkpoint(replace=True)

    async def _on_deleted(self, event: pb.SessionDeleted, ctx: Context) -> None:
        """An app took a production session back: its pending samples are dropped, none
        arriving later is trained, and the answer names the versions that trained it."""
        group_id = event.group_id
        self._deleted.add(group_id)
        dropped_ids = self._batcher.drop_group(group_id, "deleted")
        dropped_tokens = self._batcher.dropped_tokens["deleted"]
        self._count_dropped()
        self._ledger.take((), stale=dropped_ids)
        await self._stepping.wait()  # a step that took it finishes and is in the journal
        versions = await asyncio.to_thread(self._trained_versions, group_id)
        await self._bus.producer.publish(
            pb.SessionDeletionApplied(
                group_id=group_id,
                trained_versions=versions,
                dropped_tokens=dropped_tokens,
                version=self.version,
            )
        )
        log.info(
            "session deleted",
            group_id=group_id,
            trained_versions=versions,
            dropped_tokens=dropped_tokens,
        )

    def _trained_versions(self, group_id: str) -> list[int]:
        """Versions in the current weights' history whose steps trained the group."""
        assert self._journal is not None
        prefix = f"{group_id}/"
        return sorted(
            {
                record.version
                for record in journal_lineage(read_journal(self._journal.path))
                if any(s.startswith(prefix) for s in record.samples)
            }
        )

    async def _announce(
        self,
        server: WeightSyncServer,
        checkpoint: str,
        *,
        base: int | None,
        sessions: list[str] | None = None,
    ) -> None:
        """Serve the weights held as `self.version` (unless served already: an archived
        version re-held at start) and announce them, trained from `base`."""
        assert self._policy is not None
        policy = self._policy
        manifest = server.manifest(self.version)
        if manifest is None:
            if policy.sharded:  # the followers all-gather each tensor as the server copies it
                await asyncio.to_thread(policy.world.share, ("gather", ()))
            manifest = await server.publish(
                self.version, self.step, policy.state_dict(), adapter=self._adapter
            )
        self.metrics.published_bytes.set(manifest.total_bytes)
        announced = pb.PolicyVersion(
            version=self.version,
            step=self.step,
            weightsync_address=self._address(server),
            manifest_checksum=manifest.manifest_checksum,
            checkpoint_uri=checkpoint,
            session_groups=sessions or [],
            tokens_dropped={k: v for k, v in sorted(self._dropped_since.items()) if v},
            base=base,
        )
        if self._watch is not None:  # its own lineage at once (staleness counts steps on it)
            self._watch.announced(announced)
        await self._bus.producer.publish(announced)
        self._dropped_since.clear()

    def _address(self, server: WeightSyncServer) -> str:
        return self._settings.advertise_address or server.address

    async def _finish(self, training: asyncio.Task[None]) -> None:
        """Stop training (a step in progress completes: its thread cannot be interrupted),
        checkpoint what is unsaved, and release its records before the consumer commits."""
        self._due.set()
        await asyncio.gather(training, return_exceptions=True)
        if self._ledger.unsaved:
            await self._checkpoint()
        if self._world.size > 1:
            await asyncio.to_thread(self._world.share, None)  # followers: stop


def _check_token_ids(group: pb.GroupSamples, vocab_size: int) -> None:
    """Refuse (to hrl.dlq) a group with token ids the model has no embedding for: a step on
    it would fail, and with it the training loop."""
    for sample in group.samples:
        if sample.token_ids and max(sample.token_ids) >= vocab_size:
            raise PermanentError(
                f"sample {sample.sample_id!r}: token_ids must be below the vocabulary size "
                f"({vocab_size}), got {max(sample.token_ids)}"
            )


def _report_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("training stopped by an error; /healthz now fails", error=repr(task.exception()))


def _link(group: pb.GroupSamples) -> Link:
    context = SpanContext(
        int(group.trace_id, 16), int(group.span_id, 16), True, TraceFlags(TraceFlags.SAMPLED)
    )
    return Link(context, {"harnessrl.group_id": group.group_id})


def _sessions_of(batch: Batch) -> list[str]:
    """The production sessions whose samples the batch trains."""
    trained = {s.sample_id.rsplit("/", 2)[0] for s in batch.samples}
    return sorted(
        g.group_id
        for g in batch.groups
        if g.estimator == SESSION_ESTIMATOR and g.group_id in trained
    )
