"""Settings of `harnessrl inference` (section `inference`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

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
