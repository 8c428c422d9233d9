"""`harnessrl bench trainer --sharded`: what FSDP2 saves per rank, and that it changes
nothing in the update.

One process and `torchrun --nproc-per-node N` (FSDP2, gloo on CPU, NCCL on CUDA) each
load the same model and take the same seeded steps through the trainer's `Policy.step`.
Every rank reports, after its last step:

- state bytes: the storage this rank holds for parameters, gradients and AdamW state
  (a DTensor counts its local shard), which is the figure FSDP divides by N;
- peak RSS (and peak CUDA memory on a GPU): the whole process, runtime included;
- step seconds (median over the steps after the first).

The JSON gives per-rank state bytes against the one-process figure (`state_ratio`, about
1/N), and `max_abs_diff`, the largest difference between the weights the two runs end
with (float32: around 1e-6, from the order of the reductions).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from harnessrl.command import CliError


def main(args: argparse.Namespace) -> int:
    def log(line: str) -> None:
        print(f"bench trainer --sharded: {line}", file=sys.stderr, flush=True)

    if args.ranks < 2:
        raise CliError("--ranks must be >= 2")
    with tempfile.TemporaryDirectory(prefix="harnessrl-bench-sharded-") as tmp:
        out = Path(tmp)
        log(f"one process, {args.batches} steps")
        single = _launch(args, out / "single", ranks=1)
        log(f"torchrun --nproc-per-node {args.ranks} (fsdp), {args.batches} steps")
        sharded = _launch(args, out / "sharded", ranks=args.ranks)
        diff = _max_abs_diff(
            out / "single" / "weights.safetensors", out / "sharded" / "weights.safetensors"
        )
    one = single[0]
    per_rank = [r["state_bytes"] for r in sharded]
    result = {
        "ranks": args.ranks,
        "model_params": one["params"],
        "single_state_bytes": one["state_bytes"],
        "sharded_state_bytes_per_rank": per_rank,
        "state_ratio": round(max(per_rank) / one["state_bytes"], 4),
        "single_breakdown": one["breakdown"],
        "sharded_breakdown_rank0": sharded[0]["breakdown"],
        "single_peak_rss_bytes": one["peak_rss"],
        "sharded_peak_rss_bytes_per_rank": [r["peak_rss"] for r in sharded],
        "single_peak_cuda_bytes": one["peak_cuda"],
        "sharded_peak_cuda_bytes_per_rank": [r["peak_cuda"] for r in sharded],
        "single_step_s": one["step_s"],
        "sharded_step_s": max(r["step_s"] for r in sharded),
        "max_abs_diff": diff,
        "device": one["device"],
        "batches": args.batches,
        "samples_per_batch": args.samples,
        "seed": args.seed,
    }
    if not args.json:
        for key, value in result.items():
            print(f"{key:>32}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0


def _launch(args: argparse.Namespace, out: Path, *, ranks: int) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    spec = {
        "model": str(args.model),
        "device": args.device,
        "batches": args.batches,
        "samples": args.samples,
        "lengths": [args.min_len or 64, args.max_len or 256],
        "micro_batch_tokens": args.micro_batch_tokens or 2048,
        "seed": args.seed,
    }
    worker = ["-m", "harnessrl.bench.trainer_sharded", str(out), json.dumps(spec)]
    if ranks == 1:
        command = [sys.executable, *worker]
    else:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
        command = [*torchrun, "--master-port", str(_free_port()), *worker]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise CliError(f"the {ranks}-rank run failed:\n{done.stderr[-4000:]}")
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _max_abs_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    one, two = load_file(a), load_file(b)
    return max(float((one[k] - two[k]).abs().max()) for k in one)


def _local_bytes(tensor: Any) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.numel() * local.element_size())


def _worker(argv: list[str]) -> int:
    """One rank: load, step, report (see the module docstring)."""
    import torch
    from safetensors.torch import save_file

    from harnessrl.bench.trainer import synthetic_batch
    from harnessrl.services.trainer.config import TrainerSection
    from harnessrl.services.trainer.policy import Policy
    from harnessrl.services.trainer.sharding import full

    out, spec = argv[0], json.loads(argv[1])
    settings = TrainerSection.model_validate(
        {
            "model": spec["model"],
            "device": spec["device"],
            "lr": 1e-4,
            "micro_batch_tokens": spec["micro_batch_tokens"],
            "seed": spec["seed"],
        }
    )
    policy = Policy.load(settings)
    vocab = policy.vocab_size
    rng = np.random.default_rng(spec["seed"])
    seconds = []
    for index in range(spec["batches"]):
        batch = synthetic_batch(rng, index, spec["samples"], tuple(spec["lengths"]), vocab)
        started = time.perf_counter()
        policy.step(batch)
        seconds.append(time.perf_counter() - started)
    params = list(policy.model.parameters())
    breakdown = {
        "parameters": sum(_local_bytes(p) for p in params),
        "gradients": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            _local_bytes(v)
            for state in policy.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        ),
    }
    weights = {k: full(v).detach().clone() for k, v in policy.model.state_dict().items()}
    rank = policy.world.rank
    if rank == 0:
        save_file(weights, str(Path(out) / "weights.safetensors"))
    cuda = policy.device.type == "cuda"
    report = {
        "rank": rank,
        "params": sum(p.numel() for p in params),  # a DTensor's numel is the whole one
        "state_bytes": sum(breakdown.values()),
        "breakdown": breakdown,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_cuda": int(torch.cuda.max_memory_allocated(policy.device)) if cuda else None,
        "step_s": round(statistics.median(seconds[1:] or seconds), 5),
        "device": str(policy.device),
    }
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(report))
    policy.world.close()
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
