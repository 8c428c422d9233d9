"""`harnessrl controller`: tasks in, harness runs out, every episode accounted for.

A task becomes a group of episodes (`<group_id>-<index>`); its record on hrl.tasks is held
(its offset not committed) until every episode of the group is final, so a restarted
controller gets every unfinished group again. At start it rebuilds the ledger from
hrl.episodes and recovers the runs its predecessor left (local processes are ended and
retried; Kubernetes Jobs are adopted), so each episode resumes where it stood.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge

from harnessrl import events
from harnessrl.bus import Context, Hold
from harnessrl.bus.snapshot import read_to_end
from harnessrl.logs import get_logger
from harnessrl.metrics import Labelled
from harnessrl.production import SESSION_PREFIX, parse_session_group
from harnessrl.retry import PermanentError
from harnessrl.runtime import Runtime
from harnessrl.service_bus import Handlers, ServiceBus, Subscription
from harnessrl.services.controller.admission import EpisodeAdmission
from harnessrl.services.controller.attempts import EpisodeRunner, EpisodeTask
from harnessrl.services.controller.config import MAX_GROUP_SIZE, ControllerConfig, HarnessSpec
from harnessrl.services.controller.gateway_admin import Gateways
from harnessrl.services.controller.phases import EpisodeLedger
from harnessrl.services.controller.retention import prune
from harnessrl.services.controller.runner import Runner
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


class ControllerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.launched = Counter(
            "harnessrl_controller_runs_launched", "Harness runs started.", registry=registry
        )
        self.finished = Labelled(
            Counter(
                "harnessrl_controller_attempts_finished",
                "Attempts reported, by status.",
                ["status", "final"],
                registry=registry,
            )
        )
        self.groups = Gauge("harnessrl_controller_groups", "Groups in progress.", registry=registry)
        self.running = Gauge(
            "harnessrl_controller_episodes_running", "Episodes running.", registry=registry
        )


class ControllerService:
    def __init__(self, config: ControllerConfig, runtime: Runtime) -> None:
        section = config.controller
        for name in ("token_secret", "admin_token"):
            if getattr(section, name) is None:
                raise ValueError(f"controller.{name}: required")
        if section.harness is None and not section.families:
            raise ValueError("controller.harness: required (or controller.families)")
        if section.runner == "kubernetes" and section.kubernetes is None:
            raise ValueError(
                "controller.kubernetes: required when controller.runner is "
                "kubernetes (job_template, namespace, ...)"
            )
        self._config = config
        self._runtime = runtime
        self._stopping = asyncio.Event()
        self._groups: dict[str, list[asyncio.Task[None]]] = {}
        self._ledger = EpisodeLedger()
        self._episodes: EpisodeRunner | None = None
        self._bus = ServiceBus(config, runtime)
        self.metrics = ControllerMetrics(runtime.registry)
        self.ready = asyncio.Event()
        self.admission: EpisodeAdmission | None = None
        """Versions announced and served, slots in use (set once running)."""

    async def run(self) -> None:
        section = self._config.controller
        assert section.admin_token is not None
        async with AsyncExitStack() as stack:
            producer = await self._bus.start(
                stack, topics=[events.TASKS, events.EPISODES, events.POLICY]
            )
            await self._rebuild()
            runner = self._make_runner()
            await runner.start()
            stack.push_async_callback(runner.stop)
            recovered = {(r.episode_id, r.attempt): r for r in await runner.recover()}
            admission = self.admission = EpisodeAdmission(
                max_in_flight=section.max_in_flight,
                sync=section.schedule == "sync",
                max_staleness=section.max_staleness,
                engines=section.engines,
            )
            gateways = Gateways(
                section.replicas,
                section.admin_token.get_secret_value(),
                timeout_s=section.close_timeout_s,
            )
            stack.push_async_callback(gateways.close)
            self._episodes = EpisodeRunner(
                section,
                runner=runner,
                producer=producer,
                admission=admission,
                gateways=gateways,
                tracer=self._runtime.tracer,
                recovered=recovered,
                metrics=self.metrics,
            )
            self.metrics.groups.set_function(lambda: len(self._groups))
            self.metrics.running.set_function(lambda: admission.in_flight)
            self._consume(stack, admission)
            pruning = asyncio.create_task(self._prune(), name="episode retention")
            stack.callback(pruning.cancel)
            log.info(
                "controller running",
                runner=runner.name,
                recovered=len(recovered),
                open_groups=len(self._ledger.groups),
            )
            self.ready.set()
            await self._stopping.wait()

    async def stop(self) -> None:
        self._stopping.set()

    async def _prune(self) -> None:
        """Delete the episode directories older than the retention, now and then."""
        section = self._config.controller
        timeouts = [h.timeout_s for h in (section.harness, *section.families.values()) if h]
        keep = max(section.episode_retention_s, max(timeouts, default=0.0) + 3600.0)
        while True:
            await asyncio.to_thread(prune, section.workdir, keep)
            await asyncio.sleep(min(3600.0, section.episode_retention_s / 10))

    def health(self) -> dict[str, bool]:
        return {"producer": self._bus.healthy}

    async def _rebuild(self) -> None:
        async for kind, event, _ in read_to_end(
            self._config.kafka, events.EPISODES, client_id=f"{self._runtime.producer_name}/rebuild"
        ):
            self._ledger.add(kind, event)

    def _make_runner(self) -> Runner:
        section = self._config.controller
        if section.runner == "kubernetes":
            from harnessrl.services.controller.kubernetes import KubernetesRunner

            assert section.kubernetes is not None  # checked in __init__
            return KubernetesRunner(section.kubernetes)
        from harnessrl.services.controller.local import local_runner

        return local_runner(section)

    def _consume(self, stack: AsyncExitStack, admission: EpisodeAdmission) -> None:
        # Teardown runs in reverse: stop taking tasks, stop following the policy, then end
        # the episode tasks (their runs are recovered by the next controller).
        stack.push_async_callback(self._cancel_episodes)

        async def on_version(event: pb.PolicyVersion, ctx: Context) -> None:
            await admission.announced_version(event.version)

        async def on_loaded(event: pb.PolicyLoaded, ctx: Context) -> None:
            if event.ok and await admission.loaded(event.version, event.engine):
                await self._end_stale(admission)

        policy: Handlers = {pb.PolicyVersion: on_version, pb.PolicyLoaded: on_loaded}
        group = f"harnessrl.controller.{self._config.instance}"
        self._bus.consume(stack, Subscription(group, policy))
        tasks = {pb.TaskSubmitted: self._on_task}
        self._bus.consume(
            stack, Subscription("harnessrl.controller", tasks, on_revoked=self._on_revoked)
        )

    async def _on_task(self, task: pb.TaskSubmitted, ctx: Context) -> None:
        harness, size = self._validate(task)
        if task.group_id in self._groups:
            return  # a redelivery while the group still runs
        hold = ctx.hold()
        assert self._episodes is not None
        jobs = [EpisodeTask(task, harness, i, size) for i in range(size)]
        self._groups[task.group_id] = [
            asyncio.create_task(
                self._episodes.run(job, self._ledger.episode(task.group_id, job.episode_id)),
                name=f"episode {job.episode_id}",
            )
            for job in jobs
        ]
        asyncio.create_task(self._complete(task.group_id, hold))  # noqa: RUF006 - kept in _groups

    async def _complete(self, group_id: str, hold: Hold) -> None:
        results = await asyncio.gather(*self._groups[group_id], return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if any(isinstance(r, asyncio.CancelledError) for r in failed):
            return  # shutting down: the task is redelivered to the next controller
        for error in failed:
            log.error("episode task failed", group_id=group_id, error=repr(error))
        if failed:
            return  # left held: redelivered after a restart, resumed from the ledger
        self._groups.pop(group_id, None)
        self._ledger.forget(group_id)
        hold.release()
        log.info("group complete", group_id=group_id)

    def _validate(self, task: pb.TaskSubmitted) -> tuple[HarnessSpec, int]:
        """The task's harness and group size; PermanentError (-> hrl.dlq) when unusable."""
        section = self._config.controller
        for name in ("task_id", "group_id", "input_json"):
            if not getattr(task, name):
                raise PermanentError(f"TaskSubmitted.{name}: required")
        if task.split == pb.MODE_UNSPECIFIED:
            raise PermanentError("TaskSubmitted.split: required (train or val)")
        if parse_session_group(task.group_id) is not None:
            raise PermanentError(
                f"TaskSubmitted.group_id: {task.group_id!r} is in the production sessions' "
                f"namespace ({SESSION_PREFIX}<app>.<session>); choose another"
            )
        try:
            orjson.loads(task.input_json)
            metadata = orjson.loads(task.metadata_json or "{}")
        except orjson.JSONDecodeError as err:
            raise PermanentError(
                f"TaskSubmitted: input_json/metadata_json not JSON: {err}"
            ) from None
        family = metadata.get("family") if isinstance(metadata, dict) else None
        harness = section.families.get(family) if family else section.harness
        if harness is None:
            raise PermanentError(f"TaskSubmitted.metadata.family: no harness for {family!r}")
        if task.group_size > MAX_GROUP_SIZE:
            raise PermanentError(f"TaskSubmitted.group_size: {task.group_size} > {MAX_GROUP_SIZE}")
        return harness, task.group_size or section.group_size

    async def _end_stale(self, admission: EpisodeAdmission) -> None:
        assert self._episodes is not None
        for key in admission.stale():
            run = self._episodes.runs.get(key)  # type: ignore[call-overload]
            if run is not None:
                await run.kill(
                    f"stale: started more than {self._config.controller.max_staleness}"
                    f" versions before {admission.serving}"
                )

    async def _on_revoked(self, partitions: list[tuple[str, int]]) -> None:
        # Another controller owns those tasks now; it resumes their groups from the ledger.
        log.warning("task partitions revoked", partitions=partitions)

    async def _cancel_episodes(self) -> None:
        tasks = [t for group in self._groups.values() for t in group]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
