"""Settings of `harnessrl sample-builder` (section `sample_builder`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from harnessrl.config import ServiceConfig, ServiceSection
from harnessrl.production import ProductionSection


class SampleBuilderSection(ServiceSection):
    """The sample builder: how groups become training samples."""

    port: int = Field(default=8230, ge=0, le=65535)
    """Port of /healthz and /metrics."""
    estimator: Literal["grpo", "rloo", "mean"] = "grpo"
    """Advantage estimator: grpo (mean/std), rloo (leave-one-out mean) or mean (baseline)."""
    eps: float = Field(default=1e-6, gt=0)
    """Added to the group's reward std by grpo."""
    keep_failed: bool = True
    """Train on episodes whose harness failed or timed out (with the reward they got); false
    drops them. Invalid episodes are always dropped."""
    missing_reward: Literal["drop", "fill"] = "drop"
    """An episode whose reward is missing: drop it, or use fill_value as its reward."""
    fill_value: float = 0.0
    """Reward of an episode with a missing reward when missing_reward is "fill"."""
    drop_flags: list[str] = ["tests_modified"]
    """Reward flags that drop an episode from training (e.g. tests_modified: the patch
    touched the tests; it scored 0, and is not a lesson worth learning from)."""
    max_tokens: int = Field(default=32768, ge=16)
    """Longest segment (prompt, inserted context and completions)."""
    too_long: Literal["truncate", "drop"] = "truncate"
    """A longer segment is cut at max_tokens (and marked truncated), or its episode dropped."""
    min_episodes: int = Field(default=2, ge=2)
    """Fewest kept episodes a group needs to be trained on."""
    group_timeout_s: float = Field(default=3600.0, gt=0)
    """Longest a group may wait for its last event after its first one; then it is emitted
    with its complete episodes (if enough remain) or dropped, counted either way."""
    sweep_interval_s: float = Field(default=5.0, gt=0)
    """How often groups are checked against group_timeout_s."""
    tokenizer: Path | None = None
    """Model directory whose tokenizer decodes ids at merge breaks, to tell a
    retokenization difference from others (decoding only: training never re-encodes)."""


class SampleBuilderConfig(ServiceConfig):
    """Settings of the sample builder."""

    sample_builder: SampleBuilderSection = SampleBuilderSection()
    """The sample builder."""
    production: ProductionSection = ProductionSection()
    """Production sessions: apps, their feedback, the session stores."""
