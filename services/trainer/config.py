"""Settings of `harnessrl trainer` (section `trainer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from harnessrl.config import Section, ServiceConfig, ServiceSection
from harnessrl.production import ProductionSection
from harnessrl.weights.settings import WeightSyncSettings


class LossSection(Section):
    """The policy-gradient loss (formulas in harnessrl.trust.loss)."""

    normalization: Literal["token_mean", "episode_mean", "constant"] = "episode_mean"
    """token_mean: every token counts the same; episode_mean: each episode's tokens are
    averaged, then episodes (an episode with many calls does not outweigh one with few);
    constant: divide by constant_tokens."""
    constant_tokens: int = Field(default=65536, ge=1)
    """Token budget the loss is divided by under normalization "constant"."""
    clip_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO ratio lower bound 1 - clip_low."""
    clip_high: float = Field(default=0.28, ge=0)
    """PPO ratio upper bound 1 + clip_high (asymmetric: "clip-higher")."""
    ratio_cap: float = Field(default=3.0, gt=1)
    """Truncation of the importance ratio for negative advantages (dual clip): a stale
    token whose ratio exploded cannot dominate the step."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the frozen reference model (0: no reference is loaded)."""


class LoraSection(Section):
    """Low-rank adapters (PEFT LoRA) on a frozen base: only the adapters train, and only
    they are published (the policy version is the adapter)."""

    rank: int = Field(default=16, ge=1)
    """Rank r of each adapter pair (A: r x in, B: out x r)."""
    alpha: float = Field(default=32.0, gt=0)
    """Scaling numerator: the adapter's update is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter's input (0 keeps the first pass's log-probs exact)."""
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    """Names (last component) of the linear layers that get an adapter."""
    base_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Storage of the frozen base weights; auto: bfloat16 on CUDA, float32 on CPU."""


class ShardingSection(Section):
    """How the trainer's `torchrun` ranks share the model (one process: no sharding)."""

    strategy: Literal["fsdp", "replicate"] = "fsdp"
    """fsdp: FSDP2 (`fully_shard`, one unit per transformer block): parameters, gradients
    and optimizer state are split across ranks; replicate: every rank holds everything and
    gradients are summed (plain data parallelism)."""
    reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward (less memory, one more
    all-gather in the backward pass)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """fsdp: dtype gradients are reduce-scattered in."""


class TrainerSection(ServiceSection):
    """The trainer: model, batches, optimiser, checkpoints, publication."""

    port: int = Field(default=8240, ge=0, le=65535)
    """Port of /healthz and /metrics."""
    model: Path = Path("examples/tiny-model")
    """Directory of the initial policy (any causal LM transformers loads; tokenizer too)."""
    reference_model: Path | None = None
    """Directory of the KL reference (default: the initial model) when loss.kl_coef > 0."""
    checkpoint_dir: Path = Path(".harnessrl/trainer")
    """Where checkpoints are written; the newest is resumed from at start."""
    checkpoint_every: int = Field(default=10, ge=1)
    """Steps between checkpoints (and at shutdown). Samples are acknowledged on the topic
    only once a checkpoint holds them, so a crash never skips one."""
    keep_checkpoints: int = Field(default=3, ge=1)
    """Newest checkpoints kept."""
    batch_groups: int = Field(default=8, ge=1)
    """Groups per optimiser step."""
    batch_tokens: int | None = Field(default=None, ge=1)
    """Also step once this many tokens are pending, even with fewer groups."""
    micro_batch_tokens: int = Field(default=16384, ge=16)
    """Padded tokens per forward/backward pass (gradients accumulate across them)."""
    max_staleness: int = Field(default=2, ge=0)
    """Samples whose oldest call is more than this many versions behind are dropped."""
    max_session_staleness: int = Field(default=64, ge=0)
    """The same bound for a production session's samples, whose feedback arrives hours
    later: beyond it they are dropped as too_stale (counted); within it the clipped,
    importance-weighted loss corrects with the recorded behaviour log-probs. The trainer
    remembers what it trained for the larger of the two bounds."""
    lr: float = Field(default=1e-6, gt=0)
    """AdamW learning rate after warm-up."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up steps."""
    grad_clip: float = Field(default=1.0, gt=0)
    """Global gradient-norm clip."""
    loss: LossSection = LossSection()
    """The loss."""
    lora: LoraSection | None = None
    """Train low-rank adapters instead of every weight (None: full weights)."""
    sharding: ShardingSection = ShardingSection()
    """How several `torchrun` ranks share the model."""
    gpu_memory_gib: float | None = Field(default=None, gt=0)
    """Accelerator memory per rank the start-up size check uses (default: what the device
    reports; on CPU the check is skipped)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when available."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights stay float32; auto: bf16 autocast on CUDA, float32 on CPU."""
    seed: int = 0
    """Seed of every random source (dropout, data order)."""
    schedule: Literal["async", "sync"] = "async"
    """sync: pause the gateways, publish, wait for the engines' PolicyLoaded, resume; async:
    publish and go on."""
    engines: int = Field(default=1, ge=1)
    """sync: replicas that must report PolicyLoaded(v) before the gateways resume."""
    load_timeout_s: float = Field(default=600.0, gt=0)
    """sync: longest wait for the engines to load a version; then resume anyway (logged)."""
    max_steps: int | None = Field(default=None, ge=1)
    """Training budget: after this many steps (checkpointed) the trainer stops taking
    samples and does what at_max_steps says. None: no budget."""
    at_max_steps: Literal["exit", "serve"] = "exit"
    """exit: the process ends (a batch job); serve: it goes on serving the last version
    (WeightSync, /metrics) until stopped, so engines can still fetch it and a restarted
    trainer trains no further (a long-running deployment, `harnessrl experiment`)."""
    weightsync: WeightSyncSettings = WeightSyncSettings()
    """The WeightSync gRPC server engines pull new versions from."""
    advertise_address: str | None = None
    """host:port engines reach WeightSync at (default: its bound address)."""


class TrainerConfig(ServiceConfig):
    """Settings of the trainer."""

    trainer: TrainerSection = TrainerSection()
    """The trainer."""
    production: ProductionSection = ProductionSection()
    """Production sessions (shared with the gateway and the reward service): under
    `production.canary` the trainer follows the rollout on hrl.policy, keeps the stable and
    candidate versions servable, and rewinds to the stable version after a rollback
    (trainer.sharding with FSDP across ranks is refused then)."""
