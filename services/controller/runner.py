"""How a harness run is launched, followed and ended: the contract every runner meets.

A runner (local processes, Kubernetes Jobs) starts one harness run per episode attempt
from a `LaunchSpec`, and hands back a `Run` whose `wait()` returns a `RunResult` once the
run is over: it exited, it was killed at its timeout, its infrastructure failed, or it was
abandoned (found running by a restarted controller and ended). Runs are identified by
(episode id, attempt); `recover()` finds the runs a previous controller left behind.

The harness reports its result either as a JSON file at $HARNESSRL_OUTPUT or as its last
stdout line `HARNESSRL_RESULT <json>`; `parse_result()` is the one reading of both.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import orjson

RESULT_PREFIX = "HARNESSRL_RESULT "
Outcome = Literal["exited", "timeout", "infra_error", "abandoned"]


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Everything a runner needs to start one harness run."""

    episode_id: str
    attempt: int
    group_id: str
    task_id: str
    command: tuple[str, ...]
    """The harness command (local: executed; Kubernetes: available to the Job template)."""
    env: Mapping[str, str]
    """Environment of the harness: base URLs, API keys (the token), TRACEPARENT,
    HARNESSRL_TASK, HARNESSRL_OUTPUT (set by the runner where it decides the path), ..."""
    timeout_s: float
    """Wall-clock limit; past it the run is terminated (grace, then killed)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    """Labels identifying the run (episode, attempt, group), for runners that keep them."""
    preload: tuple[str, ...] = ()
    """Local runner: modules its fork server imports (HarnessSpec.preload)."""
    gateway_url: str = ""
    """The gateway replica the episode belongs to, as harnesses reach it (a sandboxed local
    run is relayed to it); "" for the runner's default."""


@dataclass(frozen=True, slots=True)
class RunResult:
    """How a run ended."""

    outcome: Outcome
    exit_code: int | None
    """Process or container exit code; None if it never exited on its own. A negative
    value -N means it was killed by signal N (local runner)."""
    result_json: str | None
    """The harness's result as JSON text (size-capped), None when it reported none or the
    report was unusable (see result_error)."""
    result_error: str | None
    """Why the reported result is unusable, e.g. "malformed result: ...", else None."""
    message: str
    """What happened, in words (infra errors, timeouts)."""
    artifacts_uri: str
    """Where the run's logs and output files are (file:// or other URI), "" if nowhere."""
    started_at: float
    finished_at: float
    result_truncated: bool = False


class Run(Protocol):
    """A launched (or recovered) run."""

    episode_id: str
    attempt: int
    ref: str
    """Runner-specific handle: process group id, Job name."""

    async def wait(self) -> RunResult:
        """Until the run is over (enforcing its timeout); safe to call more than once."""

    async def kill(self, reason: str) -> None:
        """End the run now; wait() then returns outcome "abandoned" with `reason`."""


class Runner(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Release resources; runs in progress are left as they are (a restarted
        controller recovers them)."""

    async def launch(self, spec: LaunchSpec) -> Run:
        """Start a run. Raises LaunchError when the infrastructure refuses."""

    async def recover(self) -> list[Run]:
        """Runs a previous controller started and did not see end."""


class LaunchError(Exception):
    """The run could not be started (an infrastructure failure: retried as a new attempt)."""


def parse_result(
    output: bytes | None, stdout_tail: str, cap: int
) -> tuple[str | None, str | None, bool]:
    """(result JSON text, error, truncated) from the output file's bytes (None: no file)
    and the end of stdout. The file wins when it is present and not empty."""
    source, text = None, None
    if output is not None and output.strip():
        source, text = "HARNESSRL_OUTPUT", output.decode("utf-8", "replace")
    else:
        for line in reversed(stdout_tail.splitlines()):
            if line.strip():
                if line.startswith(RESULT_PREFIX):
                    source, text = "HARNESSRL_RESULT line", line[len(RESULT_PREFIX) :]
                break
    if text is None:
        return None, None, False
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError as err:
        return None, f"malformed result in {source}: {err}", False
    if len(text.encode()) > cap:
        return text.encode()[:cap].decode("utf-8", "ignore"), None, True
    return text, None, False
