"""Settings shared by every service, and how a service's settings are loaded.

One deployment has one YAML file (optional) whose top-level sections are shared (`kafka`,
`producer`, `consumer`, `telemetry`, `log`) or belong to one service (`gateway`, `trainer`,
...). Each service reads the shared sections and its own, and ignores the others. Environment
variables override the file: `HARNESSRL_<SECTION>__<FIELD>`, e.g.
`HARNESSRL_KAFKA__BOOTSTRAP_SERVERS=kafka:9092`. Values are validated once, at start-up, and
the resulting objects are frozen.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

CONFIG_ENV = "HARNESSRL_CONFIG"
"""Environment variable naming the YAML config file when `--config` is not given."""

KiB = 1024
MiB = 1024 * 1024
GiB = 1024 * MiB


class Section(BaseModel):
    """A block of settings: frozen, unknown keys refused, field docstrings as descriptions."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class KafkaSettings(Section):
    """How to reach the Kafka cluster, and how topics are created on it."""

    bootstrap_servers: str = "127.0.0.1:9092"
    """Comma-separated host:port list of brokers to bootstrap from."""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Transport security towards the brokers."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism when security_protocol is SASL_*."""
    sasl_username: str | None = None
    """SASL user name."""
    sasl_password: SecretStr | None = None
    """SASL password (never logged or shown)."""
    ssl_cafile: Path | None = None
    """CA bundle that signs the brokers' certificates (SSL, SASL_SSL)."""
    ssl_certfile: Path | None = None
    """Client certificate for mutual TLS."""
    ssl_keyfile: Path | None = None
    """Private key of the client certificate."""
    ssl_check_hostname: bool = True
    """Verify that the broker certificate matches its host name."""
    create_topics: bool = True
    """Create missing topics at start-up (off where topics are managed elsewhere, e.g.
    Strimzi KafkaTopic resources)."""
    partitions: int = Field(default=6, ge=1)
    """Partitions of each created topic (hrl.policy always has one)."""
    replication_factor: int = Field(default=1, ge=1)
    """Replication factor of each created topic."""
    request_timeout_ms: int = Field(default=30_000, ge=1_000)
    """How long a produce request may wait for the broker before it is retried."""
    linger_ms: int = Field(default=2, ge=0)
    """How long the producer waits to fill a batch."""
    max_batch_bytes: int = Field(default=1 * MiB, ge=16 * 1024)
    """Largest producer batch per partition."""
    max_request_bytes: int = Field(default=16 * MiB, ge=1 * MiB)
    """Largest record the producer accepts (a GroupSamples can be several MB)."""

    @field_validator("bootstrap_servers")
    @classmethod
    def _check_bootstrap(cls, value: str) -> str:
        for server in value.split(","):
            host, sep, port = server.strip().rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{server!r} is not host:port")
        return value


class ProducerSettings(Section):
    """The bus producer's buffering: it never drops an event when the broker is away."""

    buffer_max_bytes: int = Field(default=64 * MiB, ge=0)
    """Bytes of not-yet-sent events held in memory before new ones spill to disk."""
    in_flight_max_bytes: int = Field(default=16 * MiB, ge=64 * 1024)
    """Bytes handed to the Kafka client and not yet acknowledged."""
    spill_dir: Path = Path(".harnessrl/spill")
    """Directory of the append-only spill log (one sub-directory per service instance)."""
    spill_fsync: bool = False
    """fsync the spill log after each write (survives power loss, not only process death)."""
    wal: bool = False
    """Write every event to the spill log before sending it, so even events accepted just
    before a SIGKILL are sent after restart (for services with no input topic to replay)."""
    retry_backoff_ms: int = Field(default=100, ge=1)
    """First wait before re-sending after a retryable failure; doubles up to the max."""
    retry_backoff_max_ms: int = Field(default=5_000, ge=1)
    """Longest wait between re-sends."""


class ConsumerSettings(Section):
    """The bus consumer's polling, retries and group membership."""

    max_poll_records: int = Field(default=500, ge=1)
    """Records fetched per poll; offsets are committed after each processed batch."""
    poll_timeout_ms: int = Field(default=200, ge=1)
    """Longest wait for records in one poll."""
    fetch_max_wait_ms: int = Field(default=50, ge=0)
    """Longest the broker holds a fetch open waiting for new records: the floor of
    end-to-end latency when traffic is light."""
    handler_max_attempts: int = Field(default=5, ge=1)
    """Attempts at processing a record that fails with a retryable error before it goes to
    hrl.dlq."""
    retry_backoff_ms: int = Field(default=200, ge=1)
    """First wait before retrying a record; doubles per attempt."""
    session_timeout_ms: int = Field(default=10_000, ge=1_000)
    """Group session timeout: how long a silent member keeps its partitions. Tansu also
    waits half of it before completing a join, so short values start consumers faster."""
    heartbeat_interval_ms: int = Field(default=3_000, ge=100)
    """Group heartbeat interval."""
    max_poll_interval_ms: int = Field(default=600_000, ge=1_000)
    """Longest a batch may take to process before the member is considered stuck."""


class TelemetrySettings(Section):
    """Where spans go."""

    exporter: Literal["none", "otlp-grpc", "otlp-http", "jsonl"] = "none"
    """Span exporter: OTLP over gRPC or HTTP (Jaeger, a collector), an OTLP-JSON-lines file,
    or none (trace ids still propagate and appear in logs)."""
    endpoint: str | None = None
    """OTLP endpoint; default http://localhost:4317 (gRPC) or
    http://localhost:4318/v1/traces (HTTP)."""
    jsonl_path: Path = Path(".harnessrl/traces.jsonl")
    """File the jsonl exporter appends to."""
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    """Fraction of new traces recorded (children follow their parent's decision)."""


class LogSettings(Section):
    """What the service logs, and how."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Lowest level written."""
    format: Literal["json", "text"] = "json"
    """One JSON object per line, or key=value text for terminals."""
    batch_s: float = Field(default=0.2, ge=0.0, le=5.0)
    """Lines below WARNING are written in batches at most this many seconds apart (a busy
    gateway writes one access line per call: one write each would cost it ~10% of its CPU);
    warnings and errors are written at once, after what is held. 0 writes every line at
    once. A SIGKILL loses at most this much of the lines below WARNING."""


PLACEHOLDER_PREFIX = "REPLACE-ME"
"""How the deployment files mark secrets that must be replaced before use."""


MIN_SECRET_CHARS = 32
"""Shortest shared secret accepted: the episode-token key can be guessed offline from any
token a harness holds, and the admin token online, so neither may be short."""


def real_secret(value: SecretStr | None) -> SecretStr | None:
    """A shared secret as given, refusing the deployment files' public placeholders and
    secrets shorter than MIN_SECRET_CHARS."""
    if value is None:
        return value
    secret = value.get_secret_value()
    if secret.startswith(PLACEHOLDER_PREFIX):
        raise ValueError(
            f"still the placeholder {PLACEHOLDER_PREFIX}...: set a secret of your own "
            "(e.g. `openssl rand -hex 32`); the placeholders are public"
        )
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{len(secret)} characters; at least {MIN_SECRET_CHARS} are required "
            "(e.g. `openssl rand -hex 32`)"
        )
    return value


def secrets_from_files(data: Any, names: Sequence[str]) -> Any:
    """Settings input (a mapping) with each `<name>_file` (the path of a file holding the
    secret: a Docker Compose or Kubernetes secret mounted as a file) read into `<name>`, its
    last newline dropped. Secrets in files stay out of the process's environment, which
    any process of the same user may read (/proc/PID/environ). Raises ValueError naming the
    field when both are given or the file cannot be read."""
    if not isinstance(data, Mapping):
        return data
    out = dict(data)
    for name in names:
        path = out.get(f"{name}_file")
        if path is None:
            continue
        if out.get(name) is not None:
            raise ValueError(f"{name} and {name}_file: set one of them, not both")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"{name}_file: cannot read {path}: {err.strerror}") from None
        out[name] = text[:-1] if text.endswith("\n") else text
    return out


class ServiceSection(Section):
    """Per-service runtime settings: where its health and metrics endpoints listen."""

    host: str = "127.0.0.1"
    """Interface the service's HTTP endpoints bind to (0.0.0.0 in containers)."""
    port: int = Field(default=0, ge=0, le=65535)
    """Port of /healthz and /metrics (and the service's own API, if it has one); 0 picks a
    free port."""
    shutdown_timeout_s: float = Field(default=20.0, gt=0)
    """Longest an orderly shutdown may take before remaining work is cancelled."""


class ServiceConfig(BaseSettings):
    """Base of every service's settings: the shared sections plus the instance name."""

    model_config = SettingsConfigDict(
        env_prefix="HARNESSRL_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",  # the shared file holds other services' sections too
        use_attribute_docstrings=True,
        hide_input_in_errors=True,  # a refused value may be a secret
    )

    instance: str = Field(default_factory=socket.gethostname)
    """Name of this replica, unique among the service's replicas (default: host name)."""
    kafka: KafkaSettings = KafkaSettings()
    """Kafka connection and topic creation."""
    producer: ProducerSettings = ProducerSettings()
    """Producer buffering and spill."""
    consumer: ConsumerSettings = ConsumerSettings()
    """Consumer polling and retries."""
    telemetry: TelemetrySettings = TelemetrySettings()
    """Tracing export."""
    log: LogSettings = LogSettings()
    """Logging."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: explicit arguments > environment > YAML file > defaults.
        return (init_settings, env_settings, YamlConfigSettingsSource(settings_cls))


C = TypeVar("C", bound=ServiceConfig)


def load_config(cls: type[C], config_file: Path | str | None = None, **overrides: Any) -> C:
    """Load `cls` from the environment and the YAML file (`config_file`, else $HARNESSRL_CONFIG).

    `overrides` are explicit values (from command-line flags) that win over both. Raises
    pydantic.ValidationError naming every bad field, or FileNotFoundError for a missing file.
    """
    path = config_file or os.environ.get(CONFIG_ENV)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        # The YAML source reads its path from model_config; bind it on a throwaway subclass
        # so no global state changes.
        bound_config = {**cls.model_config, "yaml_file": path}
        cls = type(cls.__name__, (cls,), {"model_config": bound_config})
    return cls(**overrides)


def masked(config: BaseModel) -> dict[str, Any]:
    """The config as JSON-ready data, with every secret replaced by "**********"."""
    return config.model_dump(mode="json")  # SecretStr serialises as "**********"


def secret_values(config: BaseModel) -> list[str]:
    """Every SecretStr value set anywhere in `config` (nested sections, lists, dicts): what
    a process masks in its logs."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, SecretStr):
            found.append(value.get_secret_value())
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(config)
    return found


class SharedSecretsSection(ServiceSection):
    """A service that holds the secrets the gateway and the controller share."""

    token_secret: SecretStr | None = None
    """HMAC secret of episode tokens (the same in the gateway and the controller); required."""
    admin_token: SecretStr | None = None
    """Bearer token of the gateway's admin API (the controller closes episodes with it);
    required."""
    token_secret_file: Path | None = None
    """A file holding token_secret (a Compose or Kubernetes secret), instead of the value:
    a secret in a file stays out of the process environment, which /proc shows."""
    admin_token_file: Path | None = None
    """A file holding admin_token, instead of the value."""

    _secrets = field_validator("token_secret", "admin_token")(real_secret)

    @model_validator(mode="before")
    @classmethod
    def _secret_files(cls, data: Any) -> Any:
        return secrets_from_files(data, ("token_secret", "admin_token"))
