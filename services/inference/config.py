"""Settings of `harnessrl inference` (section `inference`) and `harnessrl vllm-sync`
(section `vllm_sync`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from harnessrl.config import ServiceConfig, ServiceSection
from harnessrl.production import ProductionSection

Follow = Literal["newest", "stable", "candidate"]
"""Which version a full-weight engine serves during a canary rollout (harnessrl.rollout):
newest: the current version (`Rollout.current()`, the newest not rolled back); stable: the
stable version; candidate: the pending candidate, else the current version."""


class InferenceSection(ServiceSection):
    """The engine: which model, on what, how many requests at once."""

    port: int = Field(default=8100, ge=0, le=65535)
    """Port of the OpenAI API, /healthz and /metrics; 0 picks a free port."""
    model: Path = Path("examples/tiny-model")
    """Directory of a causal LM that transformers loads (config, weights, tokenizer)."""
    served_model_name: str | None = None
    """Name clients use in `model` (default: the model directory's name); the directory path
    is accepted too."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the model runs; auto picks CUDA when available."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype; auto is float32 on CPU and bfloat16 on CUDA."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Longest prompt + completion, in tokens (default: the model's own limit)."""
    max_batch: int = Field(default=32, ge=1)
    """Most requests decoding at once; more wait for a free slot."""
    default_max_tokens: int = Field(default=512, ge=1)
    """Completion length when a request gives none (capped by the remaining context)."""
    initial_version: int = Field(default=0, ge=0)
    """Policy version of the weights in `model`."""
    follow_policy: bool = True
    """Load each new PolicyVersion from hrl.policy over WeightSync and report PolicyLoaded."""
    advertise_url: str | None = None
    """This replica's base URL as others should reach it (default http://host:port); it is
    the engine name in PolicyLoaded and ModelCall events."""
    use_shared_memory: bool = True
    """Take weights through shared memory when the trainer offers it on this host."""
    follow: Follow = "newest"
    """production.canary.enabled and full-weight versions: which version this engine serves
    during a rollout (newest: the current version; stable; candidate: the pending candidate,
    else the current version). LoRA versions ignore it: the engine serves the stable, the
    candidate and the current version at once."""


class InferenceConfig(ServiceConfig):
    """Settings of the inference engine."""

    inference: InferenceSection = InferenceSection()
    """The engine."""
    production: ProductionSection = ProductionSection()
    """Production sessions; the engine reads `production.canary.enabled` only (canary: serve
    the rollout's versions, not just the newest)."""


class VllmSyncSection(ServiceSection):
    """`harnessrl vllm-sync`: which `vllm serve` it drives, and how."""

    port: int = Field(default=8250, ge=0, le=65535)
    """Port of /healthz and /metrics."""
    vllm_url: str | None = None
    """Root URL of the `vllm serve` to drive (no /v1), e.g. http://vllm:8100; required. It
    must run with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls
    harnessrl.weights.vllm_worker.WeightSyncWorkerExtension."""
    engine_name: str | None = None
    """This vLLM's name in PolicyLoaded events (default: vllm_url). The gateway stamps calls
    by it, so it must equal the URL the gateway has for this vLLM in gateway.engines."""
    initial_version: int = Field(default=0, ge=0)
    """Policy version of the weights vLLM loads when it starts (its --model)."""
    pause_mode: Literal["keep", "wait", "abort"] = "keep"
    """What vLLM does with requests in flight during a swap: keep (freeze them; they go on
    with the new weights after it), wait (let them finish first), abort (end them)."""
    rpc_timeout_s: float = Field(default=600.0, gt=0)
    """Longest one collective_rpc on vLLM (staging, committing a version) may take."""
    check_interval_s: float = Field(default=30.0, gt=0)
    """How often vLLM's served version is checked; a vLLM that restarted on its initial
    weights gets the newest policy version again."""
    lora_name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")
    """Set when the trainer trains LoRA adapters (trainer.lora): each version is loaded into
    vLLM as the adapter `<lora_name>-v<version>` through vLLM's runtime LoRA API (vLLM run
    with --enable-lora, --max-lora-rank at least trainer.lora.rank, --max-loras at least
    keep_adapters, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; neither dev mode nor the
    worker extension is needed), and the gateway asks for that name. Unset: full weights,
    through the worker extension."""
    adapter_dir: Path = Path(".harnessrl/vllm-adapters")
    """lora_name set: where each version's PEFT adapter directory is written
    (`<adapter_dir>/<lora_name>-v<version>`). vLLM reads it at the same path, so it must be
    on a filesystem both see (the same host, or a shared volume)."""
    keep_adapters: int = Field(default=2, ge=1)
    """lora_name set: adapters left loaded in vLLM, the newest; older ones are unloaded and
    their directories removed. Two let a call the gateway sent for the previous version,
    before it heard of the new one, still find its adapter."""
    base_model: Path | None = None
    """lora_name set: the model directory vLLM serves (its --model), when vllm-sync can read
    it: an adapter trained on another base is refused (compared by checksum)."""
    follow: Follow = "newest"
    """production.canary.enabled and lora_name unset (full weights): which version this vLLM
    serves during a rollout (newest: the current version; stable; candidate: the pending
    candidate, else the current version). With lora_name set the rollout's stable, candidate
    and current adapters are all loaded, and the stable and candidate are never unloaded."""

    @field_validator("vllm_url", "engine_name")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value.rstrip("/")


class VllmSyncConfig(ServiceConfig):
    """Settings of `harnessrl vllm-sync`."""

    vllm_sync: VllmSyncSection = VllmSyncSection()
    """The vLLM weight-sync driver."""
    production: ProductionSection = ProductionSection()
    """Production sessions; vllm-sync reads `production.canary.enabled` only."""
