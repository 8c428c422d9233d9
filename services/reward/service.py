"""`harnessrl reward`: EpisodeFinished in, RewardAssigned out, one per (episode, attempt).

Each final EpisodeFinished is scored in its own task (at most `concurrency` at once; the
consumer waits for a slot, which is the backpressure); its record stays uncommitted until
the RewardAssigned is acknowledged, so a crash re-delivers exactly the unscored episodes.
At start the service reads hrl.rewards to learn what is already scored, so a redelivered
episode is not scored twice. The service has no API beyond /healthz and /metrics: a
harness has no route to it.

Production sessions (EpisodeStarted/EpisodeFinished with `session` set) are never scored by
the configured reward: with production.apps set they go to the feedback join
(feedback_join.py), whose records commit once its store holds them, and apps send feedback
to the feedback API (feedback_api.py) on its own port, `reward.feedback_port`. The trainer's
answers to deleted sessions (SessionDeletionApplied on hrl.policy) are followed by a consumer
group of this instance's own, so the instance that holds a tombstone sees its answer.
With production.canary.enabled the canary judge (canary_judge.py) runs beside the join.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from harnessrl import events
from harnessrl.bus import Context, Hold
from harnessrl.bus.snapshot import read_to_end
from harnessrl.logs import get_logger
from harnessrl.metrics import Labelled
from harnessrl.retry import PermanentError
from harnessrl.runtime import Runtime
from harnessrl.service_bus import EventHandler, Handlers, ServiceBus, Subscription
from harnessrl.services.reward.canary_judge import CanaryJudge, CanaryMetrics
from harnessrl.services.reward.canary_store import CanaryStore
from harnessrl.services.reward.config import RewardConfig
from harnessrl.services.reward.episode import Episode
from harnessrl.services.reward.feedback_api import FeedbackApi
from harnessrl.services.reward.feedback_join import FeedbackJoin, FeedbackMetrics
from harnessrl.services.reward.feedback_store import FeedbackStore, StoreThread
from harnessrl.services.reward.jail import Jail
from harnessrl.services.reward.scoring import CallPolicy, assign
from harnessrl.services.reward.sources import FunctionScorer, Scorer, make_scorer
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)

INVALID_EPISODE = "invalid_episode"

Key = tuple[str, int]


class RewardMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.assigned = Labelled(
            Counter(
                "harnessrl_reward_assigned",
                "RewardAssigned published, by outcome (scored | missing).",
                ["outcome"],
                registry=r,
            )
        )
        self.flags = Labelled(
            Counter("harnessrl_reward_flags", "Flags raised while scoring.", ["flag"], registry=r)
        )
        self.latency = Histogram(
            "harnessrl_reward_seconds",
            "Time to score one episode (all tries).",
            buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 30, 120, 600),
            registry=r,
        )
        self.value = Histogram(
            "harnessrl_reward_value",
            "Reward values assigned (missing ones excluded).",
            buckets=(-1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 10),
            registry=r,
        )
        self.duplicates = Counter(
            "harnessrl_reward_duplicates",
            "EpisodeFinished records skipped because the attempt is already scored.",
            registry=r,
        )
        self.in_flight = Gauge("harnessrl_reward_in_flight", "Episodes being scored.", registry=r)
        self.threads_busy = Gauge(
            "harnessrl_reward_threads_busy",
            "Sync reward calls running in threads (more than in_flight: calls that ignored "
            "their timeout).",
            registry=r,
        )


class RewardService:
    def __init__(self, config: RewardConfig, runtime: Runtime) -> None:
        self._config = config
        self._runtime = runtime
        self._scorer: Scorer = make_scorer(config.reward)  # ValueError for a bad source
        self._policy = CallPolicy(
            config.reward.timeout_s, config.reward.max_retries, config.reward.retry_backoff_s
        )
        self._slots = asyncio.Semaphore(config.reward.concurrency)
        self._scored: set[Key] = set()
        self._running: dict[Key, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()
        self._bus = ServiceBus(config, runtime)
        self._tracer = runtime.tracer
        self.metrics = RewardMetrics(runtime.registry)
        self.ready = asyncio.Event()
        self._join: FeedbackJoin | None = None
        self._feedback_api: FeedbackApi | None = None
        self._judge: CanaryJudge | None = None

    @property
    def source(self) -> str:
        return self._scorer.source

    @property
    def feedback_port(self) -> int:
        """The feedback API's port once running (0 when production.apps is not set)."""
        return 0 if self._feedback_api is None else self._feedback_api.port

    async def run(self) -> None:
        config, runtime = self._config, self._runtime
        if config.reward.source == "builtin:tests":  # it never scores outside its jail
            await Jail(config.reward.tests).probe()
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self._scorer.close)
            topics = [events.EPISODES, events.REWARDS]
            if config.production.apps:
                topics.append(events.POLICY)
            await self._bus.start(stack, topics=topics)
            async for _, event, _ in read_to_end(
                config.kafka, events.REWARDS, client_id=f"{runtime.producer_name}/rebuild"
            ):
                # Sessions' rewards are the feedback store's to remember, not this set's.
                if isinstance(event, pb.RewardAssigned) and not event.HasField("session"):
                    self._scored.add((event.episode_id, event.attempt))
            if config.production.apps:
                await self._start_feedback(stack)
                if config.production.canary.enabled:
                    await self._start_judge(stack)
            elif config.production.canary.enabled:
                log.warning("production.canary.enabled: no judge without production.apps")
            # Closed in reverse: the consumer stops taking episodes, then the ones being
            # scored finish (or are cancelled), then the feedback side, then the producer
            # flushes.
            stack.push_async_callback(self._drain)
            handlers: Handlers = {
                pb.EpisodeStarted: self._on_started,
                pb.EpisodeFinished: self._on_finished,
            }
            self._bus.consume(stack, Subscription("harnessrl.reward", handlers))
            self.metrics.in_flight.set_function(lambda: len(self._running))
            if isinstance(self._scorer, FunctionScorer):
                scorer = self._scorer
                self.metrics.threads_busy.set_function(lambda: scorer.running_in_threads)
            log.info("reward service running", source=self.source, already_scored=len(self._scored))
            self.ready.set()
            await self._stopping.wait()

    async def stop(self) -> None:
        self._stopping.set()

    async def _start_feedback(self, stack: AsyncExitStack) -> None:
        """The session store, the join and its sweeps, the feedback API; closed in reverse
        (the API, the sweeps, rewards being published, the store) before the producer."""
        production, section = self._config.production, self._config.reward
        store = StoreThread(
            lambda: FeedbackStore.open(production.store, window_s=production.feedback.window_s)
        )
        await store.start()
        stack.push_async_callback(store.close)
        metrics = FeedbackMetrics(self._runtime.registry, store)
        join = FeedbackJoin(production, store, self._bus.producer, metrics)
        stack.push_async_callback(join.drain, section.shutdown_timeout_s / 2)
        sweeps = asyncio.create_task(join.run_sweeps(section.feedback_sweep_s), name="sweeps")
        stack.push_async_callback(_cancel, sweeps)
        answers = {pb.SessionDeletionApplied: _applied(join)}
        group = f"harnessrl.reward.{self._config.instance}"
        self._bus.consume(stack, Subscription(group, answers))
        api = FeedbackApi(
            production, store, join, self._tracer, self.health, delete_wait_s=section.delete_wait_s
        )
        await api.start(section.host, section.feedback_port)
        stack.push_async_callback(api.stop)
        self._join, self._feedback_api = join, api

    async def _start_judge(self, stack: AsyncExitStack) -> None:
        """The canary judge (canary_judge.py): its store, hrl.policy's history folded, then
        hrl.policy and hrl.rewards followed by a consumer group of this instance's own;
        production sessions' ends reach it from the episodes consumer (_session_event)."""
        production, runtime = self._config.production, self._runtime
        store = await asyncio.to_thread(CanaryStore, production.store)
        judge = CanaryJudge(
            production.canary,
            production.feedback,
            store,
            self._bus.producer.publish,
            CanaryMetrics(runtime.registry),
        )
        stack.push_async_callback(judge.close)
        history = read_to_end(
            self._config.kafka, events.POLICY, client_id=f"{runtime.producer_name}/canary"
        )
        await judge.start(event async for _, event, _ in history)
        handlers: Handlers = {
            pb.PolicyVersion: _event_only(judge.on_policy),
            pb.RolloutDecision: _event_only(judge.on_policy),
            pb.PolicyLoaded: _event_only(judge.on_policy),
            pb.RewardAssigned: _event_only(judge.on_reward),
        }
        group = f"harnessrl.reward.{self._config.instance}.canary"
        self._bus.consume(stack, Subscription(group, handlers))
        self._judge = judge

    def health(self) -> dict[str, bool]:
        return {"producer": self._bus.healthy}

    async def _on_started(self, event: pb.EpisodeStarted, ctx: Context) -> None:
        if event.HasField("session"):
            await self._session_event(event)

    async def _session_event(self, event: pb.EpisodeStarted | pb.EpisodeFinished) -> None:
        """A production session's event: to the join (its record commits once the store
        holds it), never to the configured reward."""
        if self._join is None:
            log.warning(
                "production session event ignored: production.apps is not set",
                episode_id=event.episode_id,
            )
        elif isinstance(event, pb.EpisodeStarted):
            await self._join.on_started(event)
        else:
            if self._judge is not None:  # its end recorded before the join decides its reward
                await self._judge.on_finished(event)
            await self._join.on_finished(event)

    async def _on_finished(self, event: pb.EpisodeFinished, ctx: Context) -> None:
        if event.HasField("session"):
            await self._session_event(event)
            return
        if not event.group_id:  # its reward could not be published (the group is its key)
            raise PermanentError("EpisodeFinished.group_id: required")
        if not event.final and not self._config.reward.score_non_final:
            return
        key = (event.episode_id, event.attempt)
        if key in self._scored or key in self._running:
            self.metrics.duplicates.inc()
            return
        await self._slots.acquire()
        hold = ctx.hold()
        self._running[key] = asyncio.create_task(
            self._score(key, event, hold), name=f"score {event.episode_id}/{event.attempt}"
        )

    async def _score(self, key: Key, event: pb.EpisodeFinished, hold: Hold) -> None:
        try:
            with self._tracer.start_as_current_span("reward.score") as span:
                span.set_attribute("harnessrl.episode_id", event.episode_id)
                span.set_attribute("harnessrl.attempt", event.attempt)
                span.set_attribute("harnessrl.reward.source", self.source)
                assigned = await self._assign(event)
                span.set_attribute("harnessrl.reward.missing", assigned.missing)
                if not assigned.missing:
                    span.set_attribute("harnessrl.reward.value", assigned.value)
                await self._bus.producer.publish(assigned)
            self._count(assigned)
            self._scored.add(key)
            hold.release()
        except asyncio.CancelledError:
            raise  # shutting down: left uncommitted, scored again by the next instance
        except Exception as err:
            # Only publishing can fail here (the producer stopped or refused the record):
            # the record stays uncommitted and is scored again after a restart.
            log.error("reward not published", episode_id=event.episode_id, error=repr(err))
        finally:
            self._running.pop(key, None)
            self._slots.release()

    async def _assign(self, event: pb.EpisodeFinished) -> pb.RewardAssigned:
        try:
            episode = Episode.from_event(event)
        except ValueError as err:
            return pb.RewardAssigned(
                episode_id=event.episode_id,
                attempt=event.attempt,
                group_id=event.group_id,
                flags=[INVALID_EPISODE],
                source=self.source,
                missing=True,
                message=f"cannot score: {err}",
            )
        return await assign(self._scorer, episode, self._policy)

    def _count(self, assigned: pb.RewardAssigned) -> None:
        self.metrics.assigned("missing" if assigned.missing else "scored").inc()
        for flag in assigned.flags:
            self.metrics.flags(flag).inc()
        self.metrics.latency.observe(assigned.latency_ms / 1000)
        if not assigned.missing:
            self.metrics.value.observe(assigned.value)
        log.info(
            "reward assigned",
            episode_id=assigned.episode_id,
            attempt=assigned.attempt,
            value=assigned.value,
            missing=assigned.missing,
            flags=list(assigned.flags),
            latency_ms=round(assigned.latency_ms, 3),
            message=assigned.message[:200],
        )

    async def _drain(self) -> None:
        """Once the consumer stopped, let the episodes being scored finish (half the shutdown
        budget), then cancel the rest: they are scored again after a restart."""
        running = list(self._running.values())
        if running:
            _, pending = await asyncio.wait(
                running, timeout=self._config.reward.shutdown_timeout_s / 2
            )
            for leftover in pending:
                leftover.cancel()
            await asyncio.gather(*pending, return_exceptions=True)


def _applied(join: FeedbackJoin) -> EventHandler:
    async def on_applied(event: pb.SessionDeletionApplied, ctx: Context) -> None:
        await join.on_applied(event)

    return on_applied


def _event_only(handle: Callable[[Any], Awaitable[None]]) -> EventHandler:
    async def on_event(event: Any, ctx: Context) -> None:
        await handle(event)

    return on_event


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
