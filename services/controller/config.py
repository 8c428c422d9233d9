"""Settings of `harnessrl controller` (section `controller`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from harnessrl.config import GiB, MiB, Section, ServiceConfig, SharedSecretsSection

MAX_GROUP_SIZE = 1024
"""Largest group a task may ask for (TaskSubmitted.group_size): a group's episodes are all
set up at once."""

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
    preload: list[str] = []
    """Local runner, `python SCRIPT ...` commands only: modules a fork server (the
    controller's own interpreter) imports once; each run is then forked from it instead of
    started afresh, which saves the interpreter start and those imports (e.g. ["openai"]:
    ~0.5 s of CPU per run). The run is otherwise the same: own session, directory,
    environment, argv, stdio. Empty: every run is a fresh process. Sandboxed runs
    (controller.sandbox) never use it: they are executed through bwrap."""


class KubernetesSettings(Section):
    """How harness runs become Kubernetes Jobs."""

    namespace: str = "default"
    """Namespace the Jobs are created in."""
    job_template: Path
    """YAML file of a batch/v1 Job with placeholders ${EPISODE_ID}, ${ATTEMPT}, ${GROUP_ID},
    ${TASK_ID}, ${JOB_NAME}, ${COMMAND_JSON} (validated when the runner is built)."""
    kubeconfig: Path | None = None
    """kubeconfig file to reach the cluster with; None: the in-cluster service account."""
    ttl_seconds_after_finished: int = Field(default=600, ge=0)
    """Seconds Kubernetes keeps a finished Job (and its pod and log) before deleting it."""
    poll_interval_s: float = Field(default=5.0, gt=0)
    """How often a run reads its Job while the watch is down, and its pod until the harness
    has started."""
    resync_interval_s: float = Field(default=60.0, gt=0)
    """How often a run re-reads its Job even while the watch is up (a missed event costs
    at most this long)."""
    watch_timeout_s: int = Field(default=300, ge=1)
    """Server-side length of one watch request; it is then reopened where it ended."""
    timeout_grace_s: float = Field(default=30.0, ge=0)
    """How long past its timeout a Job may run (Kubernetes should have ended it) before the
    runner deletes it and reports "timeout"."""
    pending_timeout_s: float = Field(default=300.0, gt=0)
    """Longest the harness may wait to start (no pod, unschedulable, image not pulled)
    before the Job is deleted and the run reported "infra_error"."""
    log_tail_lines: int = Field(default=1000, ge=1)
    """Lines of the pod log fetched when the run ends."""
    log_tail_bytes: int = Field(default=2 * MiB, ge=1024)
    """Bytes of those lines kept; the result line must fit in them."""
    result_cap_bytes: int = Field(default=1 * MiB, ge=1)
    """Largest result JSON reported; a longer one is truncated (result_truncated)."""
    allow_uncontained: bool = False
    """Start even when the job template would not contain harness pods (not under the
    harness NetworkPolicy's label, a service account token, the node's namespaces,
    privileges, Kubernetes Secrets): by default the controller refuses, naming what."""
    delete_after_collect: bool = True
    """Delete a Job once its result is read; else keep it (for its TTL) labelled collected."""


MAX_SANDBOX_UID = 2**31 - 1
"""Highest uid a sandboxed run gets (uids stay positive as signed 32-bit numbers, which
some tools assume)."""


class SandboxSettings(Section):
    """How local harness runs are contained (see services/controller/sandbox.py)."""

    mode: Literal["off", "bwrap", "auto"] = "off"
    """off: runs execute as the controller's user with its view of the machine; bwrap: each
    run in a bubblewrap sandbox (a run whose sandbox cannot be set up fails as an
    infrastructure error, never runs unsandboxed); auto: bwrap when it is installed, else
    off (with a warning at start)."""
    bwrap: str = "bwrap"
    """The bubblewrap program (a name looked up on PATH, or a path)."""
    read_only: list[Path] = []
    """Absolute paths a harness may read besides the system directories, the Python
    installations and what its command names (e.g. a task's venv, a dataset)."""
    max_processes: int = Field(default=1024, ge=8)
    """Processes and threads one run may have at once (its sandbox's init included); a
    fork bomb stops here."""
    max_address_space_bytes: int | None = Field(default=16 * GiB, ge=64 * MiB)
    """Virtual memory of each process of a run (RLIMIT_AS); None: unlimited."""
    max_file_bytes: int | None = Field(default=4 * GiB, ge=1 * MiB)
    """Largest file a run's process may write (RLIMIT_FSIZE); None: unlimited."""
    max_open_files: int = Field(default=4096, ge=64)
    """Open file descriptors of each process of a run (RLIMIT_NOFILE)."""
    max_cpu_s: int | None = Field(default=3600, ge=1)
    """CPU seconds of each process of a run (RLIMIT_CPU); None: unlimited."""
    tmp_bytes: int = Field(default=1 * GiB, ge=1 * MiB)
    """Size of the run's private /tmp and /dev/shm (memory-backed)."""
    max_gateway_connections: int = Field(default=128, ge=1)
    """Connections a run may hold open to the gateway at once."""
    uid_base: int = Field(default=2_100_000_000, ge=1000, le=MAX_SANDBOX_UID)
    """Controller running as root: runs get the unprivileged uids uid_base, uid_base+1, ...
    (one per run in progress, so each run's process limit is its own). Two controllers on
    one machine need distinct ranges."""
    setup_timeout_s: float = Field(default=30.0, gt=0)
    """Longest the sandbox may take to start the harness before the run fails."""

    @field_validator("read_only")
    @classmethod
    def _absolute(cls, value: list[Path]) -> list[Path]:
        relative = [str(path) for path in value if not path.is_absolute()]
        if relative:
            raise ValueError(f"{', '.join(relative)}: not absolute (the sandbox has no cwd)")
        return value


def http_url(value: str) -> str:
    """`value` when it is an http(s)://host[:port] URL; ValueError naming it otherwise."""
    parts = urlsplit(value)
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError as err:
        raise ValueError(f"{value!r}: {err}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{value!r} is not an http(s)://host[:port] URL")
    return value


class GatewayReplica(Section):
    """One gateway replica: its name (its `gateway.replica`) and where it is reached."""

    name: str = Field(min_length=1, max_length=128)
    url: str
    """Base URL as harnesses reach it."""
    admin_url: str | None = None
    """Base URL of its admin API as the controller reaches it (default url)."""

    _urls = field_validator("url")(http_url)


class ControllerSection(SharedSecretsSection):
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
    """Base URL of the gateway as harnesses reach it (one unnamed gateway; see `gateways`)."""
    gateway_admin_url: str | None = None
    """Base URL of the gateway's admin API as the controller reaches it (default gateway_url)."""
    gateways: list[GatewayReplica] = []
    """Several gateway replicas (instead of gateway_url): each episode belongs to one, chosen
    by rendezvous hashing of its id over the names; its harness is given that replica's URL,
    its token names it, and it is closed there."""
    token_margin_s: float = Field(default=300.0, ge=0)
    """How long a token outlives its run's timeout."""
    group_size: int = Field(default=4, ge=1, le=MAX_GROUP_SIZE)
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
    episode_retention_s: float = Field(default=7 * 86_400.0, ge=3600.0)
    """A run's directory under `workdir` is deleted once nothing in it changed for this long
    (never a run in progress: it is kept at least the harness timeout plus an hour)."""
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
    kubernetes: KubernetesSettings | None = None
    """Where and how harnesses run as Kubernetes Jobs (required when runner is
    "kubernetes")."""
    sandbox: SandboxSettings = SandboxSettings()
    """Local runner: the containment of each harness run (default off)."""

    @field_validator("inherit_env")
    @classmethod
    def _inherit_env(cls, value: list[str]) -> list[str]:
        settings = [name for name in value if name.upper().startswith("HARNESSRL_")]
        if settings:
            raise ValueError(
                f"{', '.join(settings)}: HARNESSRL_* variables are the services' settings "
                "(their secrets among them); a harness never inherits them"
            )
        return value

    @field_validator("gateway_url")
    @classmethod
    def _gateway_url(cls, value: str) -> str:
        return http_url(value)

    @field_validator("gateways")
    @classmethod
    def _gateways(cls, value: list[GatewayReplica]) -> list[GatewayReplica]:
        names = [r.name for r in value]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"replica names must differ: {', '.join(twice)} given twice")
        return value

    @property
    def replicas(self) -> list[GatewayReplica]:
        """The gateway replicas: `gateways`, or the one unnamed gateway of gateway_url."""
        return self.gateways or [
            GatewayReplica.model_construct(
                name="", url=self.gateway_url, admin_url=self.gateway_admin_url
            )
        ]

    @model_validator(mode="after")
    def _gateways_or_gateway_url(self) -> ControllerSection:
        both = {"gateway_url", "gateway_admin_url"} & self.model_fields_set
        if self.gateways and both:
            raise ValueError(
                f"gateways: give the replicas or {' and '.join(sorted(both))} (one unnamed "
                "gateway), not both"
            )
        return self

    @model_validator(mode="after")
    def _sandbox_is_local(self) -> ControllerSection:
        if self.runner != "local" and self.sandbox.mode != "off":
            raise ValueError(
                "sandbox.mode: contains local runs only; a Kubernetes Job's pod is contained "
                "by its template (set controller.sandbox.mode: off)"
            )
        return self


class ControllerConfig(ServiceConfig):
    """Settings of the episode controller."""

    controller: ControllerSection = ControllerSection()
    """The controller."""
