"""Running one episode to its end: attempts, tokens, the harness, closing, reporting.

`EpisodeRunner.run()` takes an episode from wherever the ledger says it stands (not
started, an attempt left open by a previous controller, or done) through as many attempts
as its verdicts allow, and returns once its final attempt is reported. Each attempt:
admission (a slot, the served policy version), a fresh token, EpisodeStarted, the harness,
closing the episode at the gateway (so every call is on hrl.calls), EpisodeFinished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from harnessrl.bus import Producer
from harnessrl.episode_token import EpisodeClaims, harness_env, mint
from harnessrl.logs import get_logger
from harnessrl.services.controller.admission import EpisodeAdmission
from harnessrl.services.controller.config import ControllerSection, HarnessSpec
from harnessrl.services.controller.gateway_admin import Gateways
from harnessrl.services.controller.phases import AttemptState, EpisodeRecord, Phase, judge
from harnessrl.services.controller.runner import LaunchError, LaunchSpec, Run, Runner, RunResult
from harnessrl.telemetry import inject_headers, span_ids
from harnessrl.v1 import events_pb2 as pb

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class EpisodeTask:
    """What an episode of a group needs from its task."""

    task: pb.TaskSubmitted
    harness: HarnessSpec
    index: int
    group_size: int

    @property
    def episode_id(self) -> str:
        return f"{self.task.group_id}-{self.index}"

    @property
    def mode(self) -> pb.Mode.ValueType:
        return pb.MODE_VAL if self.task.split == pb.MODE_VAL else pb.MODE_TRAIN


class EpisodeRunner:
    """Everything attempts need; one per controller."""

    def __init__(
        self,
        settings: ControllerSection,
        *,
        runner: Runner,
        producer: Producer,
        admission: EpisodeAdmission,
        gateways: Gateways,
        tracer: trace.Tracer,
        recovered: dict[tuple[str, int], Run],
        metrics: Any,
    ) -> None:
        assert settings.token_secret is not None
        self.settings = settings
        self.runner = runner
        self.producer = producer
        self.admission = admission
        self.gateways = gateways
        self.tracer = tracer
        self.recovered = recovered
        self.metrics = metrics
        self.runs: dict[tuple[str, int], Run] = {}
        self._secret = settings.token_secret.get_secret_value().encode()

    async def run(self, job: EpisodeTask, record: EpisodeRecord) -> None:
        """Take the episode to its final attempt (idempotent given the ledger record)."""
        if record.done:
            return
        attempt = record.started or 1
        if record.open_attempt is not None:  # left running by a previous controller
            retry = await self._resume(job, record.open_attempt)
            if not retry:
                return
            attempt = record.open_attempt + 1
        elif record.finished:  # the last reported attempt asked for a retry
            attempt = max(record.finished) + 1
        with self.tracer.start_as_current_span(
            f"episode {job.episode_id}",
            kind=SpanKind.INTERNAL,
            context=trace.set_span_in_context(trace.INVALID_SPAN),
        ) as span:
            if span.is_recording():
                span.set_attributes(
                    {
                        "harnessrl.episode_id": job.episode_id,
                        "harnessrl.group_id": job.task.group_id,
                        "harnessrl.task_id": job.task.task_id,
                    }
                )
            while await self._attempt(job, attempt):
                attempt += 1

    async def _resume(self, job: EpisodeTask, attempt: int) -> bool:
        run = self.recovered.pop((job.episode_id, attempt), None)
        if run is None:
            now = time.time()
            result = RunResult(
                "abandoned",
                None,
                None,
                None,
                "controller restarted and found no trace of the run",
                "",
                now,
                now,
            )
        else:
            log.info(
                "following a run adopted from a previous controller",
                episode_id=job.episode_id,
                attempt=attempt,
                ref=run.ref,
            )
            result = await run.wait()
        return await self._report(job, attempt, result, version=self.admission.serving)

    async def _attempt(self, job: EpisodeTask, attempt: int) -> bool:
        """One attempt; True when the episode should be tried again."""
        key = (job.episode_id, attempt)
        version = await self.admission.acquire(key)
        state = AttemptState(job.episode_id, attempt)
        try:
            with self.tracer.start_as_current_span(f"attempt {attempt}", kind=SpanKind.INTERNAL):
                env, started = self._environment(job, attempt), time.time()
                await self._publish_started(job, attempt, version, env)
                state.advance(Phase.RUNNING)
                result = await self._launch_and_wait(job, attempt, env, started)
                state.advance(Phase.CLOSING)
                retry = await self._report(job, attempt, result, version)
                state.advance(Phase.FINISHED)
                return retry
        finally:
            self.runs.pop(key, None)
            await self.admission.release(key)

    async def _launch_and_wait(
        self, job: EpisodeTask, attempt: int, env: dict[str, str], started: float
    ) -> RunResult:
        spec = LaunchSpec(
            episode_id=job.episode_id,
            attempt=attempt,
            group_id=job.task.group_id,
            task_id=job.task.task_id,
            command=tuple(job.harness.command),
            env=env,
            timeout_s=job.harness.timeout_s,
            labels={"episode": job.episode_id, "attempt": str(attempt), "group": job.task.group_id},
            preload=tuple(job.harness.preload),
            gateway_url=self.gateways.owner(job.episode_id).url,
        )
        try:
            run = await self.runner.launch(spec)
        except LaunchError as err:
            return RunResult("infra_error", None, None, None, str(err), "", started, time.time())
        self.runs[(job.episode_id, attempt)] = run
        self.metrics.launched.inc()
        return await run.wait()

    def _environment(self, job: EpisodeTask, attempt: int) -> dict[str, str]:
        settings = self.settings
        replica = self.gateways.owner(job.episode_id)
        claims = EpisodeClaims(
            job.episode_id,
            attempt,
            job.task.group_id,
            "val" if job.mode == pb.MODE_VAL else "train",
            time.time() + job.harness.timeout_s + settings.token_margin_s,
            traceparent=_traceparent(),
            gateway=replica.name,
        )
        token = mint(claims, self._secret)
        return {
            **job.harness.env,
            **harness_env(replica.url, token),
            "TRACEPARENT": claims.traceparent,
            "HARNESSRL_TASK": job.task.input_json,
        }

    async def _publish_started(
        self, job: EpisodeTask, attempt: int, version: int, env: dict[str, str]
    ) -> None:
        event = pb.EpisodeStarted(
            episode_id=job.episode_id,
            attempt=attempt,
            group_id=job.task.group_id,
            task_id=job.task.task_id,
            index=job.index,
            group_size=job.group_size,
            mode=job.mode,
            policy_version=version,
            runner=self.runner.name,
            trace_id=span_ids()[0],
        )
        event.started_at.FromNanoseconds(time.time_ns())
        await self.producer.publish(event)
        log.info("episode started", episode_id=job.episode_id, attempt=attempt, version=version)

    async def _report(
        self, job: EpisodeTask, attempt: int, result: RunResult, version: int
    ) -> bool:
        """Close at the gateway, judge, publish EpisodeFinished; True to retry."""
        try:
            calls = await self.gateways.admin(job.episode_id).close_episode(
                job.episode_id, attempt, job.task.group_id, reason=result.outcome
            )
        except Exception as err:  # reported below; the sample builder times the group out
            log.error(
                "episode could not be closed at the gateway",
                episode_id=job.episode_id,
                attempt=attempt,
                error=repr(err),
            )
            calls = -1
        verdict = judge(
            result,
            attempt=attempt,
            max_attempts=self.settings.max_attempts,
            retryable_exit_codes=frozenset(job.harness.retryable_exit_codes),
        )
        event = pb.EpisodeFinished(
            episode_id=job.episode_id,
            attempt=attempt,
            group_id=job.task.group_id,
            task_id=job.task.task_id,
            mode=job.mode,
            status=verdict.status,
            reason=verdict.reason,
            result_json=result.result_json or "",
            result_truncated=result.result_truncated,
            artifacts_uri=result.artifacts_uri,
            final=not verdict.retry,
            task_input_json=job.task.input_json,
            task_metadata_json=job.task.metadata_json,
            policy_version=version,
        )
        if result.exit_code is not None:
            event.exit_code = result.exit_code
        event.started_at.FromNanoseconds(int(result.started_at * 1e9))
        event.finished_at.FromNanoseconds(int(result.finished_at * 1e9))
        await self.producer.publish(event)
        self.metrics.finished(pb.EpisodeStatus.Name(verdict.status), str(not verdict.retry)).inc()
        log.info(
            "episode finished",
            episode_id=job.episode_id,
            attempt=attempt,
            status=pb.EpisodeStatus.Name(verdict.status),
            reason=verdict.reason,
            retry=verdict.retry,
            calls=calls,
        )
        return verdict.retry


def _traceparent() -> str:
    carrier = inject_headers([])
    return carrier[0][1].decode() if carrier else ""
