"""Reading a harness Job and its pod: has it finished, did it start, how did it end.

Pure functions over the API's JSON objects (camelCase keys, as the API server sends them).
The harness container is the first container of the pod; its exit code is the run's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harnessrl.services.controller.runner import Outcome

Obj = Mapping[str, Any]

# Waiting reasons that will not resolve by waiting: the run fails now.
_FATAL_WAITING = frozenset({"InvalidImageName", "ErrImageNeverPull"})


@dataclass(frozen=True, slots=True)
class Finish:
    """A Job's terminal condition."""

    kind: str
    """"Complete" or "Failed"."""
    reason: str
    """The condition's reason, e.g. "DeadlineExceeded", "BackoffLimitExceeded"."""
    message: str


@dataclass(frozen=True, slots=True)
class Pending:
    """Why the harness container has not started yet."""

    message: str
    fatal: bool
    """True when waiting cannot help (an invalid image name): fail the run now."""


def finish_of(job: Obj) -> Finish | None:
    """The Job's Complete or Failed condition (status "True"); None while it is running."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return Finish(cond["type"], cond.get("reason") or "", cond.get("message") or "")
    return None


def latest_pod(pods: Sequence[Obj]) -> Obj | None:
    """The most recently created pod (a Job with retries may have several)."""
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)


def _container(pod: Obj, container: str) -> Obj:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return dict(status)
    return {}


def _terminated(pod: Obj, container: str) -> Obj | None:
    status = _container(pod, container)
    # With restartPolicy OnFailure a restarted container's previous end is in lastState.
    for key in ("state", "lastState"):
        terminated = (status.get(key) or {}).get("terminated")
        if terminated:
            return dict(terminated)
    return None


def exit_code(pod: Obj, container: str) -> int | None:
    """The harness container's exit code, None when it has not terminated."""
    terminated = _terminated(pod, container)
    return None if terminated is None else int(terminated["exitCode"])


def started(pod: Obj, container: str) -> bool:
    """True once the harness container has run: it is running, has terminated, or is
    waiting to be restarted after a run (restartPolicy OnFailure)."""
    status = _container(pod, container)
    state = status.get("state") or {}
    ran_before = "terminated" in (status.get("lastState") or {})
    return "running" in state or "terminated" in state or ran_before


def pending(pod: Obj | None, container: str) -> Pending:
    """Why the harness has not started: no pod yet, not scheduled, image not pulled, ..."""
    if pod is None:
        return Pending("no pod created for the Job yet", fatal=False)
    name = pod["metadata"]["name"]
    waiting = (_container(pod, container).get("state") or {}).get("waiting") or {}
    if waiting.get("reason"):
        reason = waiting["reason"]
        message = (
            f"pod {name}: container {container} waiting: {reason}: {waiting.get('message', '')}"
        )
        return Pending(message.rstrip(": "), fatal=reason in _FATAL_WAITING)
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            why = f"{cond.get('reason', '')}: {cond.get('message', '')}".strip(": ")
            return Pending(f"pod {name} not scheduled: {why}", fatal=False)
    return Pending(f"pod {name} is {(pod.get('status') or {}).get('phase', 'Pending')}", False)


def disruption(pod: Obj) -> str | None:
    """Why the pod was ended by the cluster rather than by its harness (eviction,
    preemption, node drain), None when it was not."""
    status = pod.get("status") or {}
    name = pod["metadata"]["name"]
    if status.get("reason") == "Evicted":
        return f"pod {name} evicted: {status.get('message', '')}".rstrip(": ")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            return f"pod {name} disrupted: {cond.get('reason', '')}: {cond.get('message', '')}"
    return None


def outcome_of(finish: Finish, pod: Obj | None, container: str) -> tuple[Outcome, int | None, str]:
    """(outcome, exit code, message) of a finished Job, given its latest pod (None: gone)."""
    code = None if pod is None else exit_code(pod, container)
    if finish.kind == "Failed" and finish.reason == "DeadlineExceeded":
        return "timeout", code, f"Job exceeded activeDeadlineSeconds: {finish.message}"
    if pod is not None and (why := disruption(pod)) is not None:
        return "infra_error", code, why
    if code is not None:
        terminated = _terminated(pod, container) if pod is not None else None
        reason = (terminated or {}).get("reason") or ""
        return "exited", code, f"container {container} exited with code {code} {reason}".strip()
    if finish.kind == "Complete":
        return "exited", 0, "Job complete; its pod is gone (exit code 0 from the Job condition)"
    where = "its pod is gone" if pod is None else f"container {container} never terminated"
    return "infra_error", None, f"Job failed ({finish.reason}: {finish.message}); {where}"
