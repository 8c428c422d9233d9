"""A stand-in Kubernetes API server for the Kubernetes runner's tests.

It is a stand-in because no Kubernetes cluster can run here. It serves, on a loopback port
with the project's own HttpServer, exactly the endpoints the runner calls, in the API
server's JSON shapes (so the real kubernetes_asyncio client talks to it unchanged):

- jobs (batch/v1, one namespace): create (409 AlreadyExists, 422 for an invalid name or
  label), get, list with label selectors (`k=v`, `k!=v`, `k`, `!k`) and paging, watch
  (initial ADDED events, or events after a resourceVersion, or 410 Gone for an expired
  one; bookmarks are never sent; `timeoutSeconds` honoured), merge-patch of labels and
  annotations, delete (pods go too, unless propagationPolicy is Orphan);
- pods: list by label selector; read a container's log (`tailLines`; 400 while it waits to
  start, 404 once the pod is gone).

Each created Job is played by a `Script`: its pod appears Pending, then runs, then ends
with an exit code and a log; or it is never scheduled, or its image cannot be pulled, or it
hangs, or it is evicted. `activeDeadlineSeconds` ends the Job with DeadlineExceeded (the
pod is deleted), as the Job controller does, unless the script says to ignore it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import random
import re
import string
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import parse_qs

import orjson
from kubernetes_asyncio.client import Configuration

from harnessrl.http import HttpServer, Request, Response, StreamingResponse

Json = dict[str, Any]
_JOBS = re.compile(r"^/apis/batch/v1/namespaces/([^/]+)/jobs(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)/(log))?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass
class Script:
    """How the stand-in plays a Job's pod."""

    exit_code: int = 0
    log: str = ""
    """What the harness container writes (stdout and stderr together)."""
    start_s: float = 0.05
    """Time Pending (container creating) before the container runs."""
    run_s: float | None = 0.1
    """Time running before it exits; None: runs until deleted (or its deadline)."""
    schedule: Literal["ok", "unschedulable", "image_pull_backoff", "invalid_image"] = "ok"
    """Anything but "ok": the pod never starts."""
    enforce_deadline: bool = True
    """End the Job at activeDeadlineSeconds (DeadlineExceeded); False: a Job that outlives
    its deadline (what the runner's own timeout is for)."""
    evict: bool = False
    """The pod is evicted while running (exit code 137, reason Evicted)."""


def _stamp() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> Response:
    body = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    return Response(code, [("content-type", "application/json")], orjson.dumps(body))


def _json(body: Any, status: int = 200) -> Response:
    return Response(status, [("content-type", "application/json")], orjson.dumps(body))


def selector(text: str) -> Callable[[Json], bool]:
    """A label selector (equality terms, `k`, `!k`) as a predicate on an object."""
    terms: list[Callable[[dict[str, str]], bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            terms.append(lambda labels, k=k, v=v: labels.get(k) != v)
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            terms.append(lambda labels, k=k, v=v: labels.get(k) == v)
        elif term.startswith("!"):
            terms.append(lambda labels, k=term[1:]: k not in labels)
        else:
            terms.append(lambda labels, k=term: k in labels)
    return lambda obj: all(t(obj["metadata"].get("labels") or {}) for t in terms)


class KubeStandin:
    """The stand-in API server; see the module docstring. `jobs`, `pods`, `created` and
    `deletes` are there for tests to look at (and change)."""

    def __init__(self, namespace: str = "harness") -> None:
        self.namespace = namespace
        self.jobs: dict[str, Json] = {}
        self.pods: dict[str, Json] = {}
        self.logs: dict[str, str] = {}
        self.scripts: dict[str, Script] = {}
        """Script of each episode id (annotation harnessrl/episode-id); else `default`."""
        self.default = Script()
        self.created: list[Json] = []
        """Every create request's body, as received."""
        self.deletes: list[tuple[str, str | None]] = []
        """(Job name, propagationPolicy) of every delete request."""
        self.requests: list[tuple[str, str, str]] = []
        """(method, path, query) of every request."""
        self.create_error: int | None = None
        """Answer create requests with this status (e.g. 403)."""
        self.watch_error: int | None = None
        """Answer watch requests with this status (e.g. 500)."""
        self.expire_versions = 0
        """Answer this many watches that resume from a resourceVersion with an ERROR event
        410 Gone (the version is too old), as the API server does after compaction."""
        self._rv = itertools.count(1)
        self._history: list[tuple[int, str, Json]] = []
        self._watchers: list[tuple[Callable[[Json], bool], asyncio.Queue[tuple[str, Json]]]] = []
        self._plays: dict[str, asyncio.Task[None]] = {}
        self._server = HttpServer(self._handle, host="127.0.0.1", port=0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.port}"

    def configuration(self) -> Configuration:
        """A client configuration pointing at the stand-in."""
        return Configuration(host=self.url)

    async def start(self) -> None:
        await self._server.start()

    async def stop(self) -> None:
        for task in self._plays.values():
            task.cancel()
        await asyncio.gather(*self._plays.values(), return_exceptions=True)
        await self._server.stop(grace_s=0.2)

    # --- what tests do to the "cluster" ---------------------------------------------------

    def add_job(self, manifest: Json) -> Json:
        """Create a Job as if another client had (it is played like any other)."""
        return self._create(copy.deepcopy(manifest))

    def delete_job(self, name: str) -> None:
        """Delete a Job behind the runner's back (kubectl delete)."""
        self._delete(name, "Background")

    def watchers(self) -> int:
        return len(self._watchers)

    # --- HTTP --------------------------------------------------------------------------

    async def _handle(self, request: Request) -> Response | StreamingResponse:
        query = {k: v[-1] for k, v in parse_qs(request.query).items()}
        self.requests.append((request.method, request.path, request.query))
        if (m := _JOBS.match(request.path)) is not None and m.group(1) == self.namespace:
            name = m.group(2)
            if name is None and request.method == "POST":
                return self._post_job(orjson.loads(request.body))
            if name is None and request.method == "GET":
                if query.get("watch", "").lower() == "true":
                    return self._watch(query)
                return self._list(self.jobs, "JobList", "batch/v1", query)
            if name is not None:
                return self._job_request(request, name, query)
        if (m := _PODS.match(request.path)) is not None and m.group(1) == self.namespace:
            if m.group(2) is None and request.method == "GET":
                return self._list(self.pods, "PodList", "v1", query)
            if m.group(3) == "log" and request.method == "GET":
                return self._log(m.group(2), query)
        return _status(404, "NotFound", f"the server could not find {request.path}")

    def _job_request(self, request: Request, name: str, query: dict[str, str]) -> Response:
        job = self.jobs.get(name)
        if job is None:
            return _status(404, "NotFound", f'jobs.batch "{name}" not found')
        if request.method == "GET":
            return _json(job)
        if request.method == "DELETE":
            options = orjson.loads(request.body) if request.body else {}
            policy = query.get("propagationPolicy") or options.get("propagationPolicy")
            self._delete(name, policy)
            return _json({"kind": "Status", "apiVersion": "v1", "status": "Success"})
        if request.method == "PATCH":
            patch = orjson.loads(request.body).get("metadata") or {}
            for key in ("labels", "annotations"):
                job["metadata"][key] = {**(job["metadata"].get(key) or {}), **patch.get(key, {})}
            self._changed(job)
            return _json(job)
        return _status(405, "MethodNotAllowed", request.method)

    def _post_job(self, body: Json) -> Response:
        self.created.append(copy.deepcopy(body))
        if self.create_error is not None:
            return _status(self.create_error, "Forbidden", "jobs.batch is forbidden (test)")
        name = body.get("metadata", {}).get("name", "")
        if name in self.jobs:
            return _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
        problem = _invalid(body)
        if problem:
            return _status(422, "Invalid", f'Job.batch "{name}" is invalid: {problem}')
        return _json(self._create(body), 201)

    def _list(self, store: dict[str, Json], kind: str, api: str, query: dict[str, str]) -> Response:
        match = selector(query.get("labelSelector", ""))
        items = [o for o in store.values() if match(o)]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or 0) or len(items)
        page, more = items[start : start + limit], start + limit < len(items)
        meta = {
            "resourceVersion": str(self._last_rv()),
            **({"continue": str(start + limit)} if more else {}),
        }
        return _json({"kind": kind, "apiVersion": api, "metadata": meta, "items": page})

    def _watch(self, query: dict[str, str]) -> Response | StreamingResponse:
        if self.watch_error is not None:
            return _status(self.watch_error, "InternalError", "watch failed (test)")
        match = selector(query.get("labelSelector", ""))
        since = query.get("resourceVersion")
        if since and self.expire_versions > 0:
            self.expire_versions -= 1
            gone = {"kind": "Status", "status": "Failure", "reason": "Expired", "code": 410}
            event = {"type": "ERROR", "object": {**gone, "message": f"too old: {since}"}}
            return Response(
                200, [("content-type", "application/json")], orjson.dumps(event) + b"\n"
            )
        if since:
            backlog = [(t, j) for rv, t, j in self._history if rv > int(since) and match(j)]
        else:
            backlog = [("ADDED", copy.deepcopy(j)) for j in self.jobs.values() if match(j)]
        queue: asyncio.Queue[tuple[str, Json]] = asyncio.Queue()
        watcher = (match, queue)
        self._watchers.append(watcher)
        timeout_s = float(query.get("timeoutSeconds") or 1800)

        async def events() -> AsyncIterator[bytes]:
            try:
                for kind, job in backlog:
                    yield orjson.dumps({"type": kind, "object": job}) + b"\n"
                async with asyncio.timeout(timeout_s):
                    while True:
                        kind, job = await queue.get()
                        yield orjson.dumps({"type": kind, "object": job}) + b"\n"
            except TimeoutError:
                return
            finally:
                self._watchers.remove(watcher)

        return StreamingResponse(200, [("content-type", "application/json")], events())

    def _log(self, pod_name: str, query: dict[str, str]) -> Response:
        pod = self.pods.get(pod_name)
        if pod is None:
            return _status(404, "NotFound", f'pods "{pod_name}" not found')
        container = query.get("container") or pod["spec"]["containers"][0]["name"]
        state = next(
            s["state"] for s in pod["status"]["containerStatuses"] if s["name"] == container
        )
        if "waiting" in state:
            reason = state["waiting"]["reason"]
            message = f'container "{container}" in pod "{pod_name}" is waiting to start: {reason}'
            return _status(400, "BadRequest", message)
        lines = self.logs.get(pod_name, "").splitlines(keepends=True)
        if "tailLines" in query:
            lines = lines[-int(query["tailLines"]) :] if int(query["tailLines"]) else []
        return Response(200, [("content-type", "text/plain")], "".join(lines).encode())

    # --- the "cluster" ----------------------------------------------------------------------

    def _last_rv(self) -> int:
        return self._history[-1][0] if self._history else 0

    def _create(self, job: Json) -> Json:
        meta = job["metadata"]
        name = meta["name"]
        meta.update(uid=f"uid-{name}", creationTimestamp=_stamp(), namespace=self.namespace)
        pod_labels = job["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {})
        pod_labels.update({"job-name": name, "batch.kubernetes.io/job-name": name})
        job["status"] = {}
        self.jobs[name] = job
        self._changed(job, "ADDED")
        notes = meta.get("annotations") or {}
        script = self.scripts.get(notes.get("harnessrl/episode-id", ""), self.default)
        self._plays[name] = asyncio.create_task(self._play(name, script))
        return job

    def _changed(self, job: Json, kind: str = "MODIFIED") -> None:
        rv = next(self._rv)
        job["metadata"]["resourceVersion"] = str(rv)
        snapshot = copy.deepcopy(job)
        self._history.append((rv, kind, snapshot))
        for match, queue in self._watchers:
            if match(snapshot):
                queue.put_nowait((kind, snapshot))

    def _delete(self, name: str, policy: str | None) -> None:
        self.deletes.append((name, policy))
        job = self.jobs.pop(name, None)
        if job is None:
            return
        if (task := self._plays.pop(name, None)) is not None:
            task.cancel()
        if policy != "Orphan":
            for pod in [
                p for p in self.pods.values() if p["metadata"]["labels"]["job-name"] == name
            ]:
                self._remove_pod(pod["metadata"]["name"])
        self._changed(job, "DELETED")

    def _remove_pod(self, name: str) -> None:
        self.pods.pop(name, None)
        self.logs.pop(name, None)

    async def _play(self, name: str, script: Script) -> None:
        job = self.jobs[name]
        job["status"] = {"startTime": _stamp(), "active": 1}
        self._changed(job)
        pod = self._new_pod(job, script)
        deadline = job["spec"].get("activeDeadlineSeconds") if script.enforce_deadline else None
        limit = None if deadline is None else time.monotonic() + deadline
        if script.schedule != "ok":
            await _sleep_until(limit)
            return self._deadline_exceeded(job, pod)
        await asyncio.sleep(script.start_s)
        self._set_state(pod, {"running": {"startedAt": _stamp()}}, phase="Running")
        self.logs[pod["metadata"]["name"]] = script.log
        end = None if script.run_s is None else time.monotonic() + script.run_s
        ends = [t for t in (end, limit) if t is not None]
        await _sleep_until(min(ends) if ends else None)
        if end is None or (limit is not None and limit < end):
            return self._deadline_exceeded(job, pod)
        if script.evict:
            pod["status"].update(reason="Evicted", message="The node was low on resource: memory.")
            pod["status"]["conditions"].append(
                {"type": "DisruptionTarget", "status": "True", "reason": "TerminationByKubelet"}
            )
            return self._end(job, pod, 137, "Error")
        self._end(job, pod, script.exit_code, "Completed" if script.exit_code == 0 else "Error")

    def _new_pod(self, job: Json, script: Script) -> Json:
        name = f"{job['metadata']['name']}-{''.join(random.choices(string.ascii_lowercase, k=5))}"
        template = copy.deepcopy(job["spec"]["template"])
        waiting = {
            "ok": ("ContainerCreating", ""),
            "unschedulable": None,
            "image_pull_backoff": ("ImagePullBackOff", 'Back-off pulling image "x"'),
            "invalid_image": ("InvalidImageName", 'couldn\'t parse image name "x"'),
        }[script.schedule]
        scheduled = {"type": "PodScheduled", "status": "True"}
        if waiting is None:
            scheduled = {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
        pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "uid": f"uid-{name}",
                "creationTimestamp": _stamp(),
                "labels": template["metadata"]["labels"],
                "annotations": template["metadata"].get("annotations") or {},
            },
            "spec": template["spec"],
            "status": {"phase": "Pending", "conditions": [scheduled], "containerStatuses": []},
        }
        if waiting is not None:
            reason, message = waiting
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
            self._set_state(pod, state)
        self.pods[name] = pod
        return pod

    def _set_state(self, pod: Json, state: Json, phase: str | None = None) -> None:
        pod["status"]["containerStatuses"] = [
            {
                "name": c["name"],
                "image": c["image"],
                "imageID": "",
                "ready": "running" in state,
                "restartCount": 0,
                "state": copy.deepcopy(state),
            }
            for c in pod["spec"]["containers"]
        ]
        if phase is not None:
            pod["status"]["phase"] = phase

    def _end(self, job: Json, pod: Json, code: int, reason: str) -> None:
        terminated = {"exitCode": code, "reason": reason, "finishedAt": _stamp()}
        self._set_state(
            pod, {"terminated": terminated}, phase="Succeeded" if code == 0 else "Failed"
        )
        if code == 0 and pod["status"].get("reason") != "Evicted":
            condition = {"type": "Complete", "status": "True"}
            job["status"].update(succeeded=1, active=0, completionTime=_stamp())
        else:
            condition = {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
            }
            job["status"].update(failed=1, active=0)
        job["status"]["conditions"] = [condition]
        self._changed(job)

    def _deadline_exceeded(self, job: Json, pod: Json) -> None:
        self._remove_pod(pod["metadata"]["name"])
        job["status"].update(failed=1, active=0)
        job["status"]["conditions"] = [
            {
                "type": "Failed",
                "status": "True",
                "reason": "DeadlineExceeded",
                "message": "Job was active longer than specified deadline",
            }
        ]
        self._changed(job)


async def _sleep_until(when: float | None) -> None:
    if when is None:
        await asyncio.Event().wait()  # until cancelled (the Job is deleted)
    else:
        await asyncio.sleep(max(0.0, when - time.monotonic()))


def _invalid(job: Json) -> str | None:
    """What the API server would refuse in `job` (names and labels), None if nothing."""
    name = job["metadata"].get("name", "")
    if len(name) > 63 or not _DNS_LABEL.match(name):
        return f"metadata.name: Invalid value: {name!r}"
    for where, meta in (
        ("metadata", job["metadata"]),
        ("spec.template.metadata", job["spec"]["template"].get("metadata") or {}),
    ):
        for value in (meta.get("labels") or {}).values():
            if len(value) > 63 or not _LABEL_VALUE.match(value):
                return f"{where}.labels: Invalid value: {value!r}"
    return None
