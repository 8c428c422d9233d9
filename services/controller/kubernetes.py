"""Harness runs as Kubernetes Jobs: the runner "kubernetes".

Each episode attempt is one Job made from the user's template (see kubernetes_job.py),
named after the episode and attempt, so a second launch of the same attempt finds the first
Job (409) and follows it instead. A run is followed through one shared watch of the
namespace's harnessrl Jobs (polling while the watch is down); its outcome is read from the
Job's condition and the harness container's termination (kubernetes_status.py), its result
from the last `HARNESSRL_RESULT <json>` line of the pod's log. The timeout is enforced twice:
by Kubernetes (`activeDeadlineSeconds`) and by the run itself after a grace period, in case
the Job outlives it anyway.

Needs, in the namespace: jobs create/get/list/watch/patch/delete; pods list; pods/log get.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

from kubernetes_asyncio import config as kube_config
from kubernetes_asyncio.client import ApiClient, Configuration
from kubernetes_asyncio.client.exceptions import ApiException

from harnessrl.logs import get_logger
from harnessrl.services.controller.config import KubernetesSettings
from harnessrl.services.controller.kubernetes_api import (
    JobApi,
    JobWatch,
    Json,
    describe,
    is_transient,
)
from harnessrl.services.controller.kubernetes_job import (
    ATTEMPT_KEY,
    COLLECTED_LABEL,
    EPISODE_KEY,
    MANAGED_BY,
    MANAGED_BY_LABEL,
    JobTemplate,
    TemplateError,
)
from harnessrl.services.controller.kubernetes_run import KubernetesRun
from harnessrl.services.controller.runner import (
    LaunchError,
    LaunchSpec,
    Run,
)

log = get_logger(__name__)

MANAGED_SELECTOR = f"{MANAGED_BY_LABEL}={MANAGED_BY}"
ApiClientFactory = Callable[[], Awaitable[ApiClient]]


class KubernetesRunner:
    """Runs harnesses as Jobs; see the module docstring.

    The API client is `api_client` (left open: the caller owns it), or one built from
    `configuration`, from `api_client_factory()`, or from the settings' kubeconfig (else
    in-cluster); a client the runner builds it closes in `stop()`. Raises TemplateError
    (a ValueError) when the Job template is unusable.
    """

    name = "kubernetes"

    def __init__(
        self,
        settings: KubernetesSettings,
        *,
        api_client: ApiClient | None = None,
        configuration: Configuration | None = None,
        api_client_factory: ApiClientFactory | None = None,
    ) -> None:
        if sum(x is not None for x in (api_client, configuration, api_client_factory)) > 1:
            raise ValueError("give at most one of api_client, configuration, api_client_factory")
        self._settings = settings
        self._template = JobTemplate.load(settings.job_template, settings.namespace)
        uncontained = self._template.uncontained()
        if uncontained and not settings.allow_uncontained:
            raise TemplateError(
                f"job template {settings.job_template}: harness pods would not be contained: "
                f"{'; '.join(uncontained)} (fix the template, or set "
                "controller.kubernetes.allow_uncontained: true to run them so)"
            )
        self._given = api_client
        self._configuration = configuration
        self._factory = api_client_factory
        self._client: ApiClient | None = None
        self._api: JobApi | None = None
        self._watch: JobWatch | None = None
        self._watch_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect and start watching (once; later calls do nothing)."""
        if self._api is not None:
            return
        client = self._given or await self._open_client()
        self._client = None if self._given else client
        self._api = JobApi(client, self._settings.namespace)
        self._watch = JobWatch(
            self._api,
            MANAGED_SELECTOR,
            timeout_s=self._settings.watch_timeout_s,
            retry_s=self._settings.poll_interval_s,
        )
        self._watch_task = asyncio.create_task(self._watch.run(), name="kubernetes-job-watch")

    async def _open_client(self) -> ApiClient:
        if self._factory is not None:
            return await self._factory()
        configuration = self._configuration
        if configuration is None:
            configuration = Configuration()
            if self._settings.kubeconfig is not None:
                await kube_config.load_kube_config(
                    config_file=str(self._settings.kubeconfig), client_configuration=configuration
                )
            else:
                # Unannotated in kubernetes_asyncio.
                kube_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        return ApiClient(configuration)

    async def stop(self) -> None:
        """Stop watching and close the client the runner built (idempotent). Jobs keep
        running; a later runner's recover() finds them."""
        task, self._watch_task = self._watch_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        client, self._client = self._client, None
        if client is not None:
            await client.close()

    def _ready(self) -> tuple[JobApi, JobWatch]:
        if self._api is None or self._watch is None or self._watch_task is None:
            raise RuntimeError("KubernetesRunner used before start() or after stop()")
        return self._api, self._watch

    async def launch(self, spec: LaunchSpec) -> KubernetesRun:
        """Create the Job of `spec`, or adopt the one this episode attempt already has.

        Raises LaunchError when the API refuses or cannot be reached.
        """
        api, _ = self._ready()
        manifest = self._template.render(
            spec,
            namespace=self._settings.namespace,
            ttl_seconds=self._settings.ttl_seconds_after_finished,
        )
        name = manifest["metadata"]["name"]
        started_at = time.time()
        try:
            try:
                job = await api.create(manifest)
            except ApiException as err:
                if err.status != 409:
                    raise
                job = await self._adopt(api, name, spec)
                started_at = _created_at(job)
        except LaunchError:
            raise
        except Exception as err:
            if not (isinstance(err, ApiException) or is_transient(err)):
                raise
            raise LaunchError(f"Job {name}: {describe(err)}") from err
        log.info("job launched", job=name, episode_id=spec.episode_id, attempt=spec.attempt)
        return self._run(job, started_at)

    async def _adopt(self, api: JobApi, name: str, spec: LaunchSpec) -> Json:
        job = await api.get(name)
        if job is None:
            raise LaunchError(f"Job {name} existed at create (409) and is gone now")
        notes = job["metadata"].get("annotations") or {}
        if (notes.get(EPISODE_KEY), notes.get(ATTEMPT_KEY)) != (spec.episode_id, str(spec.attempt)):
            raise LaunchError(
                f"Job {name} exists and belongs to episode {notes.get(EPISODE_KEY)!r} attempt "
                f"{notes.get(ATTEMPT_KEY)!r}, not {spec.episode_id!r} attempt {spec.attempt}"
            )
        log.info("job already existed; adopted", job=name)
        return job

    async def recover(self) -> list[Run]:
        """A run for each harnessrl Job of the namespace that is not being deleted and was
        not collected: still running, or finished with its result unread."""
        api, _ = self._ready()
        jobs = await api.list_jobs(f"{MANAGED_SELECTOR},!{COLLECTED_LABEL}")
        runs: list[Run] = []
        for job in jobs:
            meta = job["metadata"]
            notes = meta.get("annotations") or {}
            if meta.get("deletionTimestamp"):
                continue
            if EPISODE_KEY not in notes or ATTEMPT_KEY not in notes:
                log.warning("managed job without harnessrl annotations; ignored", job=meta["name"])
                continue
            runs.append(self._run(job, _created_at(job)))
        log.info("jobs recovered", count=len(runs))
        return runs

    def _run(self, job: Json, started_at: float) -> KubernetesRun:
        api, watch = self._ready()
        return KubernetesRun(api, watch, self._settings, job, started_at)


def _created_at(job: Json) -> float:
    stamp = job["metadata"].get("creationTimestamp")
    return datetime.fromisoformat(stamp).timestamp() if stamp else time.time()
