"""Settings of `harnessrl controller` (section `controller`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from harnessrl.config import MiB, Section, ServiceConfig, ServiceSection

DEFAULT_INHERITED_ENV = [
    "PATH",
    "HOME",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "USER",
    "SHELL",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "SSL_CERT_FILE",
]


class HarnessSpec(Section):
    """How to run one harness (one task family)."""

    command: list[str] = Field(min_length=1)
    """The harness command, e.g. ["python", "examples/calculator/harness.py"]."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Wall-clock limit of one run; then SIGTERM, then SIGKILL after the grace."""
    env: dict[str, str] = {}
    """Extra environment for the harness (never put credentials of the training side here)."""
    retryable_exit_codes: list[int] = [75]
    """Exit codes that mean "try again" (75 = EX_TEMPFAIL); retried as a new attempt."""


class ControllerSection(ServiceSection):
    """The controller: which harness, where it runs, how many at once."""

    port: int = Field(default=8210, ge=0, le=65535)
    """Port of /healthz and /metrics."""
    harness: HarnessSpec | None = None
    """The harness of tasks without a family (metadata "family"), or of every task."""
    families: dict[str, HarnessSpec] = {}
    """Harnesses by task family (a task's metadata "family")."""
    runner: Literal["local", "kubernetes"] = "local"
    """Where harnesses run: local processes or Kubernetes Jobs."""
    gateway_url: str = "http://127.0.0.1:8000"
    """Base URL of the gateway as harnesses reach it."""
    gateway_admin_url: str | None = None
    """Base URL of the gateway's admin API as the controller reaches it (default gateway_url)."""
    token_secret: SecretStr | None = None
    """HMAC secret for episode tokens (the gateway's token_secret); required."""
    admin_token: SecretStr | None = None
    """The gateway's admin token (to close episodes); required."""
    token_margin_s: float = Field(default=300.0, ge=0)
    """How long a token outlives its run's timeout."""
    group_size: int = Field(default=4, ge=1, le=1024)
    """Episodes per task when the task gives no group_size."""
    max_in_flight: int = Field(default=8, ge=1)
    """Most episodes running at once."""
    max_attempts: int = Field(default=3, ge=1)
    """Attempts per episode (retries are for infrastructure failures and crashes)."""
    schedule: Literal["async", "sync"] = "async"
    """sync: episodes start only once the engines serve the newest announced version; async:
    rollouts never stop, and episodes started more than max_staleness versions ago are ended
    and retried at the current version."""
    max_staleness: int = Field(default=2, ge=0)
    """async: most versions an in-flight episode may fall behind."""
    engines: int = Field(default=1, ge=1)
    """Engine replicas that must report PolicyLoaded(v) before v counts as served."""
    inherit_env: list[str] = DEFAULT_INHERITED_ENV
    """Variables of the controller's own environment a local harness inherits (nothing else:
    the controller's secrets never reach a harness)."""
    workdir: Path = Path(".harnessrl/episodes")
    """Local runner: root of the per-episode working directories."""
    state_dir: Path = Path(".harnessrl/controller")
    """Local runner: records of the runs in progress (for recovery after a restart)."""
    log_cap_bytes: int = Field(default=1 * MiB, ge=1024)
    """Cap on each of a run's stdout and stderr files."""
    result_cap_bytes: int = Field(default=64 * 1024, ge=256)
    """Cap on the result JSON carried in EpisodeFinished."""
    kill_grace_s: float = Field(default=5.0, gt=0)
    """Between SIGTERM and SIGKILL when a run is stopped."""
    close_timeout_s: float = Field(default=120.0, gt=0)
    """How long to keep trying to close an episode at the gateway."""


class ControllerConfig(ServiceConfig):
    """Settings of the episode controller."""

    controller: ControllerSection = ControllerSection()
    """The controller."""
