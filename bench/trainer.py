"""`harnessrl bench trainer`: the trainer's optimiser step against a bare PyTorch loop.

Both sides train the same model (two copies loaded from the same directory, so the same
initial weights) with AdamW on the same batches, alternating per batch in one process:

- trainer: `Policy.step(samples)`, everything the service pays per step once the samples
  are decoded: normalization weights, packing, forward/backward per micro-batch with the
  clipped loss, entropy and loss stats, clipping, the AdamW and scheduler steps, the stats'
  read-back;
- bare: the floor no trainer can beat, over the micro-batches `pack` makes of the same
  samples (built before the clock starts, so both see identical padded tensors): per
  micro-batch forward -> log_softmax gathered at the targets -> -(A * logp * mask).sum() /
  mask.sum() -> backward; then clip_grad_norm_, AdamW step, zero_grad. Same autocast rule
  as the trainer (bf16 on CUDA, float32 on CPU).

Batches are seeded: --samples sequences per batch of random ids below the vocabulary size,
the loss mask on the last 40% of each, behaviour log-probs near -ln(vocab) (what a freshly
initialised model gives random ids, so importance ratios stay near 1), advantages +-1.
The first batch is a warm-up for both sides and is not reported; the rest give medians.
`ratio` is the median over batches of trainer / bare seconds on the same batch.

Model FLOPs are 6 * N per trained token (forward + backward matmuls, attention scores
left out), N counting tied embeddings once (the LM head matmul is real compute; the lookup
is not). Tokens are real (unpadded) sequence tokens. MFU needs a peak, so it is reported on
CUDA only (--peak-tflops, default the H100/H200 bf16 dense figure).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from harnessrl.command import CliError

if TYPE_CHECKING:
    import torch

    from harnessrl.services.trainer.config import TrainerSection
    from harnessrl.services.trainer.policy import Policy
    from harnessrl.trust.packing import MicroBatch, SampleArrays

TINY = Path("examples/tiny-model")


@dataclass(frozen=True, slots=True)
class Size:
    min_len: int
    max_len: int
    micro_batch_tokens: int


SIZES = {
    "tiny": Size(min_len=64, max_len=256, micro_batch_tokens=2048),
    "0.5b": Size(min_len=256, max_len=1024, micro_batch_tokens=16384),
}
"""Defaults per --model-size: the tiny model on CPU runs in well under a minute; 0.5b uses
the trainer's default micro-batch budget."""


def synthetic_batch(
    rng: np.random.Generator, index: int, samples: int, lengths: tuple[int, int], vocab: int
) -> list[SampleArrays]:
    """`samples` seeded samples (see the module docstring), one episode each, built from
    pb.Sample protos as the trainer receives them."""
    from harnessrl.trust.packing import SampleArrays
    from harnessrl.v1 import events_pb2 as pb

    out = []
    for i in range(samples):
        n = int(rng.integers(lengths[0], lengths[1] + 1))
        mask = np.zeros(n, dtype=np.bool_)
        mask[int(n * 0.6) :] = True  # [T] the completion: last 40%, never position 0
        behaviour = np.minimum(-np.log(vocab) + rng.normal(0.0, 0.5, n), 0.0)
        sample_id = f"bench-b{index}-s{i}"
        sample = pb.Sample(
            sample_id=sample_id,
            episode_id=sample_id,
            attempt=1,
            token_ids=rng.integers(0, vocab, n).tolist(),
            loss_mask=mask.tolist(),
            behavior_logprobs=np.where(mask, behaviour, 0.0).tolist(),
            advantage=float(rng.choice((-1.0, 1.0))),
            temperature=1.0,
        )
        out.append(SampleArrays.from_proto(sample))
    return out


def qwen_0_5b(directory: Path, seed: int) -> Path:
    """Write a randomly initialised Qwen2 model of Qwen2.5-0.5B's shape (about 494M
    parameters, embeddings tied) to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151_936,
        max_position_embeddings=32_768,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    # transformers leaves from_config untyped
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    return directory


class Bare:
    """The bare loop: a plain model, AdamW, and the least loss a policy gradient needs."""

    def __init__(self, model_dir: Path, device: torch.device, settings: TrainerSection) -> None:
        """Loads the model from `model_dir` (with the same LoRA adapters as the trainer's
        when `settings.lora` is set); AdamW and clipping as the trainer's `settings` (the
        trainer's warm-up is off at its default, so its learning rate is constant)."""
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        self.grad_clip = settings.grad_clip
        loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.vocab = int(loaded.config.vocab_size)
        if settings.lora is not None:
            from harnessrl.services.trainer.lora import apply_lora

            loaded = apply_lora(loaded, settings.lora, device=device)
        model: torch.nn.Module = loaded
        model.to(device)
        model.train()
        self.model = model
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=settings.lr,
            betas=settings.betas,
            weight_decay=settings.weight_decay,
        )

    def step(self, batches: Sequence[MicroBatch]) -> None:
        import torch

        for micro in batches:
            ids = micro.input_ids.to(self.device, non_blocking=True)  # [B, T]
            attention = micro.attention_mask.to(self.device, non_blocking=True)  # [B, T]
            mask = micro.loss_mask.to(self.device, non_blocking=True)[:, 1:].float()  # [B, T-1]
            adv = micro.advantages.to(self.device, non_blocking=True)[:, 1:]  # [B, T-1]
            with self._autocast():
                logits = self.model(input_ids=ids, attention_mask=attention).logits  # [B, T, V]
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # [B, T-1, V]
            picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
            loss = -(adv * picked * mask).sum() / mask.sum().clamp(min=1.0)
            loss.backward()  # type: ignore[no-untyped-call]
            del logits, logp, picked, loss
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        torch.nn.utils.clip_grad_norm_(trainable, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _autocast(self) -> Any:
        import torch

        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()


def from_config(config_path: Path, directory: Path, seed: int) -> Path:
    """Write a randomly initialised model of the architecture `config_path` (a config.json
    or a directory holding one) describes to `directory`: no weights are downloaded."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    model.save_pretrained(directory)
    return directory


@contextlib.contextmanager
def model_directory(args: argparse.Namespace) -> Iterator[Path]:
    """The model both sides load: --model; a temporary random one from --model-config; or
    a temporary random 0.5B for --model-size 0.5b."""
    if args.model_size != "0.5b" and args.model_config is None:
        yield args.model
        return
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-trainer-") as tmp:
        if args.model_config is not None:
            yield from_config(args.model_config, Path(tmp), args.seed)
        else:
            yield qwen_0_5b(Path(tmp), args.seed)


@dataclass(frozen=True, slots=True)
class Row:
    """One batch: seconds of each side, real tokens, the trainer's padding fraction."""

    trainer: float
    bare: float
    tokens: int
    padding: float


def measure(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from harnessrl.services.trainer.config import LoraSection, TrainerSection
    from harnessrl.services.trainer.policy import Policy, device_for

    size = SIZES[args.model_size]
    lengths = (args.min_len or size.min_len, args.max_len or size.max_len)
    micro_batch_tokens = args.micro_batch_tokens or size.micro_batch_tokens
    if args.batches < 2:
        raise CliError("--batches must be >= 2 (the first is a warm-up)")
    if not 2 <= lengths[0] <= lengths[1]:
        raise CliError(f"lengths must satisfy 2 <= --min-len <= --max-len, got {lengths}")
    device = device_for(args.device)
    if args.model_size == "0.5b" and device.type != "cuda":
        raise CliError("--model-size 0.5b needs CUDA (training 0.5B params on CPU is not a bench)")
    lora = LoraSection(rank=args.lora_rank) if args.lora else None
    log(f"device {device}, {torch.get_num_threads()} threads, model size {args.model_size}")
    with model_directory(args) as model_dir:
        settings = TrainerSection(
            model=model_dir,
            device="cuda" if device.type == "cuda" else "cpu",
            micro_batch_tokens=micro_batch_tokens,
            lr=1e-5,
            seed=args.seed,
            lora=lora,
        )
        policy = Policy.load(settings)
        bare = Bare(model_dir, device, settings)
    params = sum(p.numel() for p in policy.model.parameters() if not _is_adapter(p, lora))
    trainable = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    log(f"{params:,} parameters ({trainable:,} trained), vocab {bare.vocab}")
    rows = alternate(policy, bare, args, lengths, log)[1:]  # the first is a warm-up

    def median(key: Callable[[Row], float]) -> float:
        return statistics.median(key(r) for r in rows)

    tokens_per_s = median(lambda r: r.tokens / r.trainer)
    # A frozen base computes no weight gradients: 4N per token (forward 2N, input grads 2N).
    flops = (6.0 if lora is None else 4.0) * params * tokens_per_s
    mfu = flops / (args.peak_tflops * 1e12) if device.type == "cuda" else None
    return {
        "trainer_step_s": round(median(lambda r: r.trainer), 5),
        "bare_step_s": round(median(lambda r: r.bare), 5),
        "ratio": round(median(lambda r: r.trainer / r.bare), 4),
        "tokens_per_s": round(tokens_per_s),
        "bare_tokens_per_s": round(median(lambda r: r.tokens / r.bare)),
        "padding_fraction": round(median(lambda r: r.padding), 4),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "model_size": args.model_size,
        "model_params": params,
        "trained_params": trainable,
        "lora_rank": None if lora is None else lora.rank,
        "peak_cuda_bytes": (
            int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
        ),
        "mfu": None if mfu is None else round(mfu, 4),
        "achieved_tflops": round(flops / 1e12, 4),
        "peak_tflops": args.peak_tflops if mfu is not None else None,
        "tokens_per_batch": round(statistics.mean(r.tokens for r in rows)),
        "min_len": lengths[0],
        "max_len": lengths[1],
        "micro_batch_tokens": micro_batch_tokens,
        "batches": args.batches,
        "measured_batches": len(rows),
        "samples_per_batch": args.samples,
        "seed": args.seed,
    }


def _is_adapter(parameter: Any, lora: Any) -> bool:
    return lora is not None and parameter.requires_grad


def alternate(
    policy: Policy,
    bare: Bare,
    args: argparse.Namespace,
    lengths: tuple[int, int],
    log: Callable[[str], None],
) -> list[Row]:
    """Per batch: a trainer step, then a bare step over `pack`'s micro-batches of the same
    samples (packed before the clock starts). CUDA is synchronised around each timing."""
    import torch

    from harnessrl.trust.packing import normalization_weights, pack

    device, loss = policy.device, policy.settings.loss

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rng = np.random.default_rng(args.seed)
    rows: list[Row] = []
    for index in range(args.batches):
        samples = synthetic_batch(rng, index, args.samples, lengths, bare.vocab)
        weights = normalization_weights(
            samples, loss.normalization, constant_tokens=loss.constant_tokens
        )
        micro = pack(samples, weights, micro_batch_tokens=policy.settings.micro_batch_tokens)
        sync()
        t0 = time.perf_counter()
        stats = policy.step(samples)
        sync()
        t1 = time.perf_counter()
        bare.step(micro)
        sync()
        t2 = time.perf_counter()
        rows.append(Row(t1 - t0, t2 - t1, stats.sequence_tokens, stats.padding))
        log(
            f"batch {index + 1}/{args.batches}{' (warm-up)' if index == 0 else ''}: "
            f"{stats.sequence_tokens} tokens in {len(micro)} micro-batches, "
            f"trainer {t1 - t0:.3f} s ({stats.sequence_tokens / (t1 - t0):,.0f} tok/s), "
            f"bare {t2 - t1:.3f} s, ratio {(t1 - t0) / (t2 - t1):.3f}, loss {stats.loss:.4f}"
        )
    return rows


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"bench trainer: {line}", file=sys.stderr, flush=True)

    result = measure(args, log)
    if not args.json:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0
