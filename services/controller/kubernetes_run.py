"""One harness run on Kubernetes: its Job followed to the end, and the result read.

The run wakes on the shared watch's news of its Job, re-reads the Job every
`resync_interval_s` (every `poll_interval_s` while the watch is down) and checks the pod
every `poll_interval_s` until the harness container has started. It ends when:

- the Job has a Complete or Failed condition: the outcome comes from that condition and the
  harness container's termination (kubernetes_status.outcome_of), the result from the last
  `HARNESSRL_RESULT` line of the pod log; then the Job is deleted (or labelled collected);
- the harness never starts (a fatal waiting reason such as InvalidImageName, or still
  pending after `pending_timeout_s`): the Job is deleted, "infra_error";
- the Job is still running `timeout_grace_s` past its timeout: the Job is deleted,
  "timeout" ("infra_error" if the harness never started);
- the Job disappears (deleted by someone else): "infra_error";
- `kill()` deleted it: "abandoned".

Transient API failures are retried on the next tick; other API errors propagate.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kubernetes_asyncio.client.exceptions import ApiException

from harnessrl.logs import get_logger
from harnessrl.services.controller import kubernetes_status as status
from harnessrl.services.controller.kubernetes_api import (
    JobApi,
    JobFeed,
    JobWatch,
    Json,
    describe,
    is_transient,
)
from harnessrl.services.controller.kubernetes_job import (
    ATTEMPT_KEY,
    EPISODE_KEY,
    TIMEOUT_KEY,
    harness_container,
)
from harnessrl.services.controller.runner import Outcome, RunResult, parse_result

if TYPE_CHECKING:
    from harnessrl.services.controller.config import KubernetesSettings

log = get_logger(__name__)


class KubernetesRun:
    """One Job followed to its end. `wait()` may be called more than once (and again after
    being cancelled); `kill()` deletes the Job."""

    def __init__(
        self,
        api: JobApi,
        watch: JobWatch,
        settings: KubernetesSettings,
        job: Json,
        started_at: float,
    ) -> None:
        meta = job["metadata"]
        notes = meta.get("annotations") or {}
        self.episode_id: str = notes[EPISODE_KEY]
        self.attempt = int(notes[ATTEMPT_KEY])
        self.ref: str = meta["name"]
        self._api, self._watch, self._settings = api, watch, settings
        self._job: Json | None = job
        self._container = harness_container(job)
        # A Job from elsewhere may lack both: then only Kubernetes enforces a limit.
        limit = notes.get(TIMEOUT_KEY) or job["spec"].get("activeDeadlineSeconds")
        self._timeout_s = math.inf if limit is None else float(limit)
        self._started_at = started_at
        # Deadlines on the loop's monotonic clock, from the wall-clock start.
        self._t0 = asyncio.get_running_loop().time() - (time.time() - started_at)
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()
        self._killed: str | None = None
        self._result: RunResult | None = None
        self._pending: status.Pending | None = None
        self._has_started = False

    async def wait(self) -> RunResult:
        """Follow the Job to its end and report it (see the module docstring). Raises the
        API's errors that are not transient (e.g. 403 Forbidden)."""
        async with self._lock:
            if self._result is None:
                feed = self._watch.subscribe(self.ref, self._wake)
                try:
                    self._result = await self._follow(feed)
                finally:
                    self._watch.unsubscribe(self.ref, feed)
            return self._result

    async def kill(self, reason: str) -> None:
        """Delete the Job; wait() returns "abandoned" with `reason` (unless it had already
        returned another outcome), even when the deletion raises an API error."""
        self._killed = reason
        self._wake.set()
        if await self._api.delete(self.ref):
            log.info("job killed", job=self.ref, reason=reason)

    async def _follow(self, feed: JobFeed) -> RunResult:
        loop = asyncio.get_running_loop()
        s = self._settings
        deadline = self._t0 + self._timeout_s + s.timeout_grace_s
        last_read = next_pod_check = loop.time()  # the Job in hand is fresh
        while True:
            self._wake.clear()
            if self._killed is not None:
                return self._result_of("abandoned", None, self._killed)
            now, retry = loop.time(), False
            try:
                if feed.deleted or feed.job is not None:
                    self._job, feed.job, last_read = feed.job, None, now
                elif feed.resync or now >= last_read + self._read_interval():
                    feed.resync, last_read = False, now
                    self._job = await self._api.get(self.ref)
                check_pod = not self._has_started and now >= next_pod_check
                if check_pod:
                    next_pod_check = now + s.poll_interval_s
                result = await self._step(now, deadline, check_pod)
                if result is not None:
                    return result
            except Exception as err:
                if not is_transient(err):
                    raise
                log.warning("kubernetes api failed; retrying", job=self.ref, error=describe(err))
                retry = True
            wake_at = min(last_read + self._read_interval(), deadline)
            if not self._has_started:
                wake_at = min(wake_at, next_pod_check)
            delay = max(wake_at - loop.time(), s.poll_interval_s if retry else 0.0)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    def _read_interval(self) -> float:
        s = self._settings
        return s.resync_interval_s if self._watch.connected else s.poll_interval_s

    async def _step(self, now: float, deadline: float, check_pod: bool) -> RunResult | None:
        """The run's result if it is over now, else None (after acting on a stuck pod)."""
        job = self._job
        if job is None:
            return self._result_of("infra_error", None, "Job deleted before it finished")
        finish = status.finish_of(job)
        if finish is not None:
            return await self._collect(finish)
        if now >= deadline:
            return await self._end_overdue()
        if check_pod and not self._has_started:
            pod = status.latest_pod(await self._api.pods(self.ref))
            if pod is not None and status.started(pod, self._container):
                self._has_started, self._pending = True, None
                return None
            self._pending = status.pending(pod, self._container)
            if self._pending.fatal or now - self._t0 >= self._settings.pending_timeout_s:
                await self._api.delete(self.ref)
                message = f"harness never started: {self._pending.message}"
                return self._result_of("infra_error", None, message)
        return None

    async def _collect(self, finish: status.Finish) -> RunResult:
        pod = status.latest_pod(await self._api.pods(self.ref))
        outcome, code, message = status.outcome_of(finish, pod, self._container)
        if outcome == "timeout" and not self._has_started and self._pending is not None:
            outcome, message = "infra_error", f"harness never started: {self._pending.message}"
        result = await self._result_with_log(outcome, code, message, pod)
        await self._clean_up()
        return result

    async def _end_overdue(self) -> RunResult:
        pod = status.latest_pod(await self._api.pods(self.ref))
        code = None if pod is None else status.exit_code(pod, self._container)
        message = (
            f"Job still running {self._settings.timeout_grace_s:g}s past its "
            f"{self._timeout_s:g}s timeout; deleted"
        )
        outcome: Outcome = "timeout"
        if pod is None or not status.started(pod, self._container):
            pending = status.pending(pod, self._container)
            outcome, message = "infra_error", f"harness never started: {pending.message}"
        result = await self._result_with_log(outcome, code, message, pod)
        await self._api.delete(self.ref)
        return result

    async def _result_with_log(
        self, outcome: Outcome, code: int | None, message: str, pod: Mapping[str, Any] | None
    ) -> RunResult:
        s = self._settings
        text, error = "", None
        if pod is not None and status.started(pod, self._container):
            try:
                tail = await self._api.log_tail(
                    pod["metadata"]["name"], self._container, s.log_tail_lines, s.log_tail_bytes
                )
                text = tail.text
                if tail.cut and len(text.strip().splitlines()) == 1:
                    # Only part of the last line is at hand: a result there cannot be read.
                    error = f"the last log line is longer than log_tail_bytes ({s.log_tail_bytes})"
            except ApiException as err:
                if err.status not in (400, 404):  # 400/404: the pod or its log is gone
                    raise
                message += f"; log unavailable: {describe(err)}"
        result_json, result_error, truncated = parse_result(None, text, s.result_cap_bytes)
        return self._result_of(
            outcome,
            code,
            message,
            result_json=result_json,
            result_error=error or result_error,
            truncated=truncated,
        )

    async def _clean_up(self) -> None:
        try:
            if self._settings.delete_after_collect:
                await self._api.delete(self.ref)
            else:
                await self._api.mark_collected(self.ref)
        except Exception as err:
            # The result is read and must not be lost to a failed clean-up: the Job's TTL
            # removes it; a recover() before then reports it again, and consumers are
            # idempotent on (episode id, attempt).
            if not (isinstance(err, ApiException) or is_transient(err)):
                raise
            log.warning("collected job not cleaned up", job=self.ref, error=describe(err))

    def _result_of(
        self,
        outcome: Outcome,
        code: int | None,
        message: str,
        *,
        result_json: str | None = None,
        result_error: str | None = None,
        truncated: bool = False,
    ) -> RunResult:
        log.info("job ended", job=self.ref, outcome=outcome, exit_code=code, message=message)
        return RunResult(
            outcome=outcome,
            exit_code=code,
            result_json=result_json,
            result_error=result_error,
            message=message,
            artifacts_uri=f"k8s://{self._api.namespace}/jobs/{self.ref}",
            started_at=self._started_at,
            finished_at=time.time(),
            result_truncated=truncated,
        )
