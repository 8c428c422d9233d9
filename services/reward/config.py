"""Settings of `harnessrl reward` (section `reward`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from harnessrl.config import GiB, KiB, MiB, Section, ServiceConfig, ServiceSection
from harnessrl.production import ProductionSection


class AnswerSettings(Section):
    """The built-in `answer` reward: the harness's final answer against the expected one."""

    answer_key: str = "answer"
    """Key of the answer in the harness's result object (a bare string or number result is
    the answer itself)."""
    expected_key: str = "answer"
    """Key of the expected answer in the task metadata."""
    match: Literal["auto", "exact", "numeric", "text"] = "auto"
    """exact: strings equal; numeric: numbers within tolerance; text: equal after
    normalisation (case, whitespace, punctuation, articles); auto: numeric when the expected
    answer is a number (taking the last number of a free-text answer), else text. A task's
    metadata "match" overrides it."""
    rel_tol: float = Field(default=1e-6, ge=0)
    """Relative tolerance of numeric matching."""
    abs_tol: float = Field(default=1e-9, ge=0)
    """Absolute tolerance of numeric matching."""


class TestsSettings(Section):
    """The built-in `tests` reward: apply the harness's patch, run the task's tests."""

    timeout_s: float = Field(default=300.0, gt=0)
    """Longest a test run may take; then its process group is killed and the score is 0
    with the flag "timeout". A task's metadata "timeout_s" may lower it, never raise it."""
    kill_grace_s: float = Field(default=2.0, gt=0)
    """Between SIGTERM and SIGKILL when a test run is cut."""
    scoring: Literal["fraction", "all_pass"] = "fraction"
    """fraction: share of the named tests that pass; all_pass: 1 only when all pass. A
    task's metadata "scoring" overrides it."""
    patch_file: str = "patch.diff"
    """Name of the patch in the episode's artifacts directory."""
    patch_key: str = "patch"
    """Key of the patch (unified diff text) in the harness's result, used when the artifacts
    hold no patch file."""
    bwrap: str = "bwrap"
    """The bubblewrap program every test run is jailed with (a name on PATH, or a path; see
    services/reward/jail.py). A run whose jail cannot be set up is an infrastructure error
    (the reward is missing), never a run outside it."""
    read_only: list[Path] = []
    """Absolute paths a test run may read besides the system directories, the task's
    Python environment and the repository copy (a dataset the suite needs, say)."""
    uid_base: int = Field(default=2_050_000_000, ge=1000, le=4_000_000_000)
    """A reward running as root runs each test as the unprivileged uid uid_base + n (one
    per run in progress)."""
    max_processes: int = Field(default=1024, ge=16)
    """Processes and threads one test run may have at once (a fork bomb stops here)."""
    max_file_bytes: int = Field(default=1 * GiB, ge=1 * MiB)
    """Largest file a test run may write."""
    tmp_bytes: int = Field(default=1 * GiB, ge=1 * MiB)
    """Size of a test run's private /tmp (its HOME and TMPDIR, memory-backed)."""

    @field_validator("read_only")
    @classmethod
    def _absolute(cls, value: list[Path]) -> list[Path]:
        relative = [str(path) for path in value if not path.is_absolute()]
        if relative:
            raise ValueError(f"{', '.join(relative)}: not absolute")
        return value

    scratch_dir: Path | None = None
    """Where the per-episode repository copies are made (default: the system temp dir);
    each copy is deleted after scoring."""
    output_cap_bytes: int = Field(default=16 * KiB, ge=1024)
    """Test output kept (its tail) for the score's message when the run fails."""
    channel_cap_bytes: int = Field(default=32 * MiB, ge=64 * KiB)
    """Most a run may write into its channel to the reward (the test guard's frames, the
    hidden cases' outputs). What comes after is read and thrown away, so the reward's memory
    stays bounded, and the run scores 0 (`channel_overflow`)."""
    cases_timeout_s: float = Field(default=120.0, gt=0)
    """Longest a run of a task's hidden cases may take (they are calls of a few functions:
    seconds, where the suite takes minutes)."""


class RewardSection(ServiceSection):
    """The reward service: which reward, how many at once, how long each may take."""

    port: int = Field(default=8220, ge=0, le=65535)
    """Port of /healthz and /metrics (the service has no other API: harnesses cannot reach
    a reward)."""
    feedback_port: int = Field(default=8260, ge=0, le=65535)
    """Port of the feedback API (POST /v1/feedback, GET and DELETE /v1/sessions/{id},
    /healthz), where
    production apps send feedback about their sessions with their own keys; served only
    when production.apps is set. 0 picks a free port."""
    feedback_sweep_s: float = Field(default=5.0, gt=0, le=3600)
    """How often sessions whose feedback window ended are decided, rewards not yet
    acknowledged are published again, and sessions past production.retention_s deleted."""
    delete_wait_s: float = Field(default=30.0, ge=0, le=600)
    """How long DELETE /v1/sessions/{id} waits for the trainer's SessionDeletionApplied
    before answering 202 (applied: false); GET /v1/sessions/{id} shows the answer once it
    arrives."""
    source: str = "builtin:answer"
    """The reward: "builtin:answer", "builtin:tests", "entrypoint:<module>:<function>"
    (sync or async Python function taking an Episode) or "grpc:<host>:<port>" (a remote
    Reward service, see protos/harnessrl/v1/reward.proto)."""
    entrypoint_dir: Path | None = None
    """Where an entrypoint: module that is not on the Python path is looked for: this
    directory, else its nearest parent that holds the module's top-level package (which
    then joins the path). Default: the config file's directory, so
    entrypoint:examples.calculator.reward:score imports from any working directory."""
    concurrency: int = Field(default=8, ge=1, le=4096)
    """Most episodes scored at once."""
    timeout_s: float = Field(default=600.0, gt=0)
    """Longest one scoring call may take; then the reward is missing ("timeout")."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a call that failed with a transient error (connection, UNAVAILABLE)."""
    retry_backoff_s: float = Field(default=0.5, gt=0)
    """First wait between retries; doubles each time, with jitter."""
    score_non_final: bool = False
    """Also score attempts the controller will retry (they never feed training)."""
    grpc_tls: bool = False
    """Reach a grpc: reward over TLS (system roots) instead of plaintext."""
    answer: AnswerSettings = AnswerSettings()
    """Settings of builtin:answer."""
    tests: TestsSettings = TestsSettings()
    """Settings of builtin:tests."""

    @field_validator("source")
    @classmethod
    def _known_kind(cls, value: str) -> str:
        kind, _, rest = value.partition(":")
        if kind not in ("builtin", "entrypoint", "grpc") or not rest:
            raise ValueError(
                "must be builtin:<name>, entrypoint:<module>:<function> or grpc:<host>:<port>"
            )
        return value


class RewardConfig(ServiceConfig):
    """Settings of the reward service."""

    reward: RewardSection = RewardSection()
    """The reward service."""
    production: ProductionSection = ProductionSection()
    """Production sessions: apps, their feedback, the session stores."""

    @model_validator(mode="before")
    @classmethod
    def _entrypoint_dir_from_file(cls, data: Any) -> Any:
        """reward.entrypoint_dir defaults to the config file's directory (load_config binds
        the file to the class it loads as `yaml_file`)."""
        config_file = cls.model_config.get("yaml_file")
        if not isinstance(config_file, str | Path) or not isinstance(data, dict):
            return data
        reward = data.get("reward") or {}
        if not isinstance(reward, dict) or reward.get("entrypoint_dir") is not None:
            return data
        directory = Path(config_file).resolve().parent
        return {**data, "reward": {**reward, "entrypoint_dir": directory}}
