"""Settings of `harnessrl gateway` (section `gateway`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator

from harnessrl.config import MiB, Section, ServiceConfig, SharedSecretsSection, real_secret
from harnessrl.production import ProductionSection


class SamplingOverrides(Section):
    """Sampling settings forced on calls of one mode (None: keep the harness's own)."""

    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    """Temperature the engine samples with."""
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    """Nucleus top_p the engine samples with."""
    neutral: dict[str, float | int] = {}
    """Sampling fields sent with these values whatever the harness asked, so the engine
    cannot fill them from elsewhere (vLLM fills an omitted field from the model's
    generation_config.json unless started with `--generation-config vllm`: Qwen3 ships
    top_k 20)."""
    drop: list[str] = []
    """Request fields removed before the engine sees them (sampling settings the trainer's
    recomputed log-probs would not reflect, and that have no neutral value to send)."""


class GatewayPeer(Section):
    """A gateway replica that serves production sessions."""

    name: str = Field(max_length=128)
    """Its `gateway.replica` name."""
    url: str
    """Its harness port's base URL as the other replicas reach it (http://host:port)."""


class GatewaySection(SharedSecretsSection):
    """The gateway: where harness calls come in and which engines answer them."""

    port: int = Field(default=8000, ge=0, le=65535)
    """Port of the harness-facing API, /healthz and /metrics, and of the admin API unless
    `admin_port` is set."""
    admin_port: int | None = Field(default=None, ge=0, le=65535)
    """Port of the admin API alone (with /healthz and /metrics); set, the harness port
    answers /admin/... with 404, so a NetworkPolicy or firewall can keep harnesses off the
    admin API altogether (0 picks a free port). Unset: the admin API is on `port`, behind
    its token only."""
    admin_host: str | None = None
    """Interface the admin port binds to (default: `host`)."""
    replica: str = Field(default="", max_length=128)
    """This replica's name, when several gateways share the episodes (the controller's
    `gateways[].name`; in Kubernetes the pod name): it accepts only tokens that name it
    (421 otherwise, nothing captured), closes only its own episodes, and recovers only its
    own from hrl.calls. "" for a deployment of one gateway."""
    peers: list[GatewayPeer] = []
    """The replicas that share production sessions, this one included (by its `replica`
    name): each session belongs to one of them (rendezvous hashing of its id), and a
    replica forwards a call of a session it does not own to the owner, so an app needs
    one address. Empty: this replica owns every session that reaches it."""
    engines: list[str] = ["http://127.0.0.1:8100"]
    """Base URLs of the inference engines; an episode sticks to one (rendezvous hashing)."""
    engine_model: str | None = None
    """Model name to ask the engines for (default: the first one their /v1/models lists).
    Harnesses may ask for any model name; it is answered under the name they asked for."""
    previous_token_secrets: list[SecretStr] = []
    """Older secrets still accepted while a rotation completes."""
    max_body_bytes: int = Field(default=8 * MiB, ge=1024)
    """Largest request body accepted (413 beyond)."""
    max_buffered_bytes: int = Field(default=256 * MiB, ge=1024)
    """Most request-body bytes held at once across the port's connections (bodies arriving,
    or whose handler has not returned); a body that would pass it gets 503 with Retry-After
    (the SDKs retry it), so stalled uploads cannot exhaust memory. At least
    `max_body_bytes`."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """A request head must arrive within this, however slowly its bytes trickle (408)."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """A request body must arrive within this after its head (408)."""
    keepalive_timeout_s: float = Field(default=75.0, gt=0)
    """An idle keep-alive connection is closed after this."""
    upstream_timeout_s: float = Field(default=600.0, gt=0)
    """Longest a call may wait for its engine."""
    upstream_attempts: int = Field(default=3, ge=1)
    """Attempts at a call whose engine fails transiently (connection refused, 502/503/504)."""
    train: SamplingOverrides = SamplingOverrides(
        temperature=1.0,
        top_p=1.0,
        neutral={
            "top_k": -1,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "min_tokens": 0,
        },
        drop=["typical_p", "logit_bias", "bad_words", "allowed_token_ids", "logits_processors"],
    )
    """Sampling forced on training episodes: by default the policy's own distribution (the
    trainer recomputes log-probs at the recorded temperature and nothing else): neutral
    values sent for every control vLLM has (its defaults: top_k -1, min_p 0, penalties 0
    and repetition 1), the rest dropped."""
    val: SamplingOverrides = SamplingOverrides()
    """Sampling forced on validation episodes (default: the harness's own settings)."""
    capture_bodies: bool = False
    """Also record each call's request and response bodies in its ModelCall."""
    body_capture_bytes: int = Field(default=64 * 1024, ge=0)
    """Cap on each captured body."""
    pause_hold_s: float = Field(default=10.0, ge=0)
    """While paused, how long a new call waits for a resume before it is answered 429."""
    pause_retry_after_s: int = Field(default=5, ge=1)
    """Retry-After of a 429 answered while paused (the SDKs retry by themselves)."""
    capture_wal: bool = True
    """Write every ModelCall to the spill log before the call is answered (the producer's
    WAL), so a gateway killed right after answering still delivers it when restarted."""
    recovery_window_s: float = Field(default=86_400.0, gt=0)
    """At start, hrl.calls is read from this long ago to learn where open episodes stood
    (their next call seq, whether closed); make it longer than any episode token lives."""
    follow_control: bool = True
    """Obey ControlCommand (pause/resume) events on hrl.policy."""
    max_tokens_policy: Literal["clamp", "reject"] = "clamp"
    """A completion budget (`max_tokens`, `max_output_tokens`, ...) larger than the room the
    prompt leaves in the context: lowered to that room (clamp, counted in
    harnessrl_gateway_max_tokens_clamped) or refused with a 400 naming the field (reject).
    A prompt that alone fills the context is a 400 either way."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Context length of the engines, in tokens (default: the `max_model_len` their
    /v1/models reports; unknown, budgets are left to the engines)."""
    unserved_tools: Literal["drop", "reject"] = "drop"
    """Tools a harness offers that the engine cannot run (OpenAI's hosted web search, file
    search, code interpreter, ...; Anthropic's server tools): left out of the prompt, the
    model never seeing them (counted in harnessrl_gateway_tools_dropped), or refused with a
    400 naming the tool. Codex offers `web_search` by default."""
    max_json_depth: int = Field(default=64, ge=8, le=200)
    """Deepest nesting of a request body accepted (400 naming the field beyond)."""
    responses_store_max: int = Field(default=10_000, ge=0)
    """Responses kept for `previous_response_id` and GET /v1/responses/{id}, over all
    episodes of this replica (oldest dropped first; an episode's go when its token expires)."""

    @model_validator(mode="after")
    def _peers_name_this_replica(self) -> GatewaySection:
        names = [p.name for p in self.peers]
        if names and self.replica not in names:
            raise ValueError(f"peers: must include this replica ({self.replica!r}) by name")
        if len(set(names)) != len(names):
            raise ValueError("peers: each replica once")
        for peer in self.peers:
            if not peer.url.startswith("http://"):
                raise ValueError(f"peers: {peer.url!r} is not an http:// URL")
        return self

    @model_validator(mode="after")
    def _budget_holds_a_body(self) -> GatewaySection:
        if self.max_buffered_bytes < self.max_body_bytes:
            raise ValueError(
                "max_buffered_bytes: must be at least max_body_bytes "
                f"({self.max_buffered_bytes} < {self.max_body_bytes})"
            )
        return self

    @field_validator("previous_token_secrets")
    @classmethod
    def _previous(cls, value: list[SecretStr]) -> list[SecretStr]:
        for secret in value:
            real_secret(secret)
        return value

    @field_validator("engines")
    @classmethod
    def _engines(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one engine URL is required")
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return [url.rstrip("/") for url in value]


class GatewayConfig(ServiceConfig):
    """Settings of the gateway."""

    gateway: GatewaySection = GatewaySection()
    """The gateway."""
    production: ProductionSection = ProductionSection()
    """Production sessions: apps, their feedback, the session stores."""
