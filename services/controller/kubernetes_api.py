"""The Kubernetes API calls of the Job runner, in one namespace, as plain JSON objects.

`JobApi` wraps the few calls the runner makes (create/get/list/delete/label Jobs, list a
Job's pods, read the end of a pod's log) and answers the API's JSON (camelCase dicts), so
the rest of the runner reads Jobs the way the API server writes them. `JobWatch` keeps one
watch open on every harnessrl Job of the namespace and wakes the run that follows a Job
when it changes: one connection however many runs are in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import orjson
from kubernetes_asyncio.client import ApiClient, BatchV1Api, CoreV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, is_retryable
from harnessrl.services.controller.kubernetes_job import COLLECTED_LABEL

log = get_logger(__name__)

Json = dict[str, Any]
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_LIST_PAGE = 500


def is_transient(exc: BaseException) -> bool:
    """True for an API failure a later identical call may not hit: connection errors,
    timeouts, and answers 408/425/429/500/502/503/504. CancelledError never is."""
    if isinstance(exc, ApiException):
        return exc.status in _TRANSIENT_STATUS
    return isinstance(exc, aiohttp.ClientError) or is_retryable(exc)


def describe(err: BaseException) -> str:
    """An API error in a few words: status, reason and the Status message."""
    if isinstance(err, ApiException):
        return f"{err.status} {err.reason}: {_api_message(err.body)}".rstrip(": ")
    return f"{type(err).__name__}: {err}"


def _api_message(body: Any) -> str:
    """The `message` of a Kubernetes Status body, else the body itself (shortened)."""
    if not body:
        return ""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
    try:
        return str(orjson.loads(text).get("message", text))[:500]
    except (orjson.JSONDecodeError, AttributeError):
        return text[:500]


async def _raw(call: Awaitable[object]) -> aiohttp.ClientResponse:
    # With _preload_content=False the client hands back the aiohttp response unread; its
    # stubs type the preloaded return.
    return cast(aiohttp.ClientResponse, await call)


async def _raise_for_status(response: aiohttp.ClientResponse) -> None:
    if response.status >= 300:
        error = ApiException(status=response.status, reason=response.reason)
        error.body = (await response.read())[:2000]
        raise error


@dataclass(frozen=True, slots=True)
class LogTail:
    """The end of a pod's log."""

    text: str
    cut: bool
    """True when bytes before `text` were dropped in the middle of a line: its first line
    is incomplete."""


class JobApi:
    """The runner's API calls in `namespace`. Errors propagate as ApiException (and aiohttp
    errors); `is_transient` says which are worth another try."""

    def __init__(self, client: ApiClient, namespace: str) -> None:
        self._client = client
        self.namespace = namespace
        self._batch = BatchV1Api(client)
        self._core = CoreV1Api(client)

    def _json(self, model: object) -> Json:
        return cast(Json, self._client.sanitize_for_serialization(model))

    async def create(self, manifest: Json) -> Json:
        """Create the Job (409 when one of that name exists)."""
        body: Any = manifest  # the client sends a plain dict as it is
        return self._json(await self._batch.create_namespaced_job(self.namespace, body))

    async def get(self, name: str) -> Json | None:
        """The Job, None when it does not exist."""
        try:
            return self._json(await self._batch.read_namespaced_job(name, self.namespace))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    async def list_jobs(self, label_selector: str) -> list[Json]:
        """Every Job matching `label_selector`, page by page."""
        jobs: list[Json] = []
        options: dict[str, Any] = {}
        while True:
            page = self._json(
                await self._batch.list_namespaced_job(
                    self.namespace, label_selector=label_selector, limit=_LIST_PAGE, **options
                )
            )
            jobs += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return jobs
            options["_continue"] = token

    async def delete(self, name: str) -> bool:
        """Delete the Job and, in the background, its pods. False when it was already gone."""
        try:
            await self._batch.delete_namespaced_job(
                name, self.namespace, propagation_policy="Background"
            )
        except ApiException as err:
            if err.status == 404:
                return False
            raise
        return True

    async def mark_collected(self, name: str) -> None:
        """Label the Job collected, so that recover() skips it (no-op when it is gone)."""
        patch = {"metadata": {"labels": {COLLECTED_LABEL: "true"}}}
        try:
            await self._batch.patch_namespaced_job(name, self.namespace, patch)
        except ApiException as err:
            if err.status != 404:
                raise

    async def watch(
        self, label_selector: str, version: str | None, timeout_s: int
    ) -> aiohttp.ClientResponse:
        """An open watch of the Jobs matching `label_selector` after resource `version`
        (None: from the current state, every Job first as ADDED), ending after
        `timeout_s`. The caller reads its JSON lines and releases it."""
        options: dict[str, Any] = {"resource_version": version} if version else {}
        response = await _raw(
            self._batch.list_namespaced_job(
                self.namespace,
                label_selector=label_selector,
                watch=True,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _preload_content=False,
                # A connection that went silent is noticed and reopened.
                _request_timeout=aiohttp.ClientTimeout(sock_read=timeout_s + 30),
                **options,
            )
        )
        try:
            await _raise_for_status(response)
        except BaseException:
            response.release()
            raise
        return response

    async def pods(self, job_name: str) -> list[Json]:
        """The Job's pods (label job-name)."""
        pods = await self._core.list_namespaced_pod(
            self.namespace, label_selector=f"job-name={job_name}"
        )
        return list(self._json(pods).get("items") or [])

    async def log_tail(self, pod: str, container: str, lines: int, max_bytes: int) -> LogTail:
        """The last `lines` lines of the container's log, of which the last `max_bytes`
        bytes are kept (read as a stream: memory stays bounded whatever the lines hold)."""
        response = await _raw(
            self._core.read_namespaced_pod_log(
                pod, self.namespace, container=container, tail_lines=lines, _preload_content=False
            )
        )
        try:
            await _raise_for_status(response)
            kept = bytearray()
            dropped_mid_line = False
            async for chunk in response.content.iter_chunked(64 * 1024):
                kept += chunk
                if len(kept) > max_bytes:
                    excess = len(kept) - max_bytes
                    dropped_mid_line = kept[excess - 1] != ord("\n")
                    del kept[:excess]
        finally:
            response.release()
        return LogTail(kept.decode("utf-8", "replace"), dropped_mid_line)


@dataclass(slots=True)
class JobFeed:
    """What the watch saw of one Job since the run following it last looked."""

    wake: asyncio.Event
    job: Json | None = None
    """The newest state seen, until the run takes it."""
    deleted: bool = False
    resync: bool = False
    """The watch restarted from scratch and may have missed events: read the Job."""


class JobWatch:
    """One watch of the namespace's Jobs matching `label_selector`, dispatched by name.

    `connected` is True while a watch stream is open; when it is not, runs poll. A watch
    that fails transiently is reopened (from the last resource version, or from scratch
    after 410 Gone, then every followed run re-reads its Job); one the API refuses for
    good (e.g. no watch permission) is given up, and runs keep polling.
    """

    def __init__(self, api: JobApi, label_selector: str, *, timeout_s: int, retry_s: float) -> None:
        self._api = api
        self._selector = label_selector
        self._timeout_s = timeout_s
        self._backoff = Backoff(first_s=retry_s, max_s=max(retry_s, 30.0))
        self._feeds: dict[str, list[JobFeed]] = {}
        self.connected = False

    def subscribe(self, name: str, wake: asyncio.Event) -> JobFeed:
        """A feed of Job `name`'s changes; `wake` is set on each."""
        feed = JobFeed(wake)
        self._feeds.setdefault(name, []).append(feed)
        return feed

    def unsubscribe(self, name: str, feed: JobFeed) -> None:
        feeds = self._feeds.get(name, [])
        if feed in feeds:
            feeds.remove(feed)
        if not feeds:
            self._feeds.pop(name, None)

    async def run(self) -> None:
        """Watch until cancelled (or refused for good)."""
        loop = asyncio.get_running_loop()
        version: str | None = None
        delays = self._backoff.delays()
        while True:
            opened = loop.time()
            try:
                version = await self._stream(version)
            except Exception as err:
                if isinstance(err, ApiException) and err.status == 410:
                    version = None  # too old: start over from the current state
                    continue
                self._wake_all()  # runs that relied on the watch start polling
                if not is_transient(err):
                    log.error("job watch stopped; following jobs by polling", error=describe(err))
                    return
                log.warning("job watch failed; retrying", error=describe(err))
                await asyncio.sleep(next(delays))
                continue
            # A watch that the server (or a proxy) ends at once must not spin.
            if loop.time() - opened < 1.0:
                await asyncio.sleep(next(delays))
            else:
                delays = self._backoff.delays()

    async def _stream(self, version: str | None) -> str | None:
        response = await self._api.watch(self._selector, version, self._timeout_s)
        try:
            self.connected = True
            if version is None:
                self._resync_all()
            async for line in response.content:
                if line.strip():
                    version = self._dispatch(orjson.loads(line)) or version
        finally:
            self.connected = False
            response.release()
        return version

    def _resync_all(self) -> None:
        for feeds in self._feeds.values():
            for feed in feeds:
                feed.resync = True
        self._wake_all()

    def _wake_all(self) -> None:
        for feeds in self._feeds.values():
            for feed in feeds:
                feed.wake.set()

    def _dispatch(self, event: Json) -> str | None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            raise ApiException(status=obj.get("code"), reason=obj.get("message"))
        meta = obj.get("metadata") or {}
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            for feed in self._feeds.get(meta.get("name", ""), []):
                feed.deleted = kind == "DELETED"
                feed.job = None if feed.deleted else obj
                feed.resync = False  # this is the Job's current state
                feed.wake.set()
        return cast(str | None, meta.get("resourceVersion"))
