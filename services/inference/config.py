"""Settings of `harnessrl inference` (section `inference`) and `harnessrl vllm-sync`
(section `vllm_sync`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from harnessrl.config import ServiceConfig, ServiceSection


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


class InferenceConfig(ServiceConfig):
    """Settings of the inference engine."""

    inference: InferenceSection = InferenceSection()
    """The engine."""


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
