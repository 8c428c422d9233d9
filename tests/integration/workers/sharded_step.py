"""Trainer steps on fixed batches, in one process or under torchrun, with the strategy
named on the command line; optionally resumed from a saved training state, and saved
(every rank its shards) after the first step. After each step k rank 0 writes the full
weights to OUT/step-k.safetensors (k counts from --first-batch). The tests compare runs.

    sharded_step.py OUT [--strategy fsdp|replicate] [--steps 1] [--first-batch 0]
                    [--resume DIR] [--save DIR] [--lora]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from harnessrl.services.trainer.config import TrainerSection
from harnessrl.services.trainer.packing import SampleArrays
from harnessrl.services.trainer.policy import Policy
from harnessrl.services.trainer.sharding import full
from harnessrl.v1 import events_pb2 as pb

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-model"


def batch(seed: int) -> list[SampleArrays]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(7):  # odd: the ranks get unequal shares of the micro-batches
        prompt = rng.integers(20, 2000, int(rng.integers(4, 12))).tolist()
        completion = rng.integers(20, 2000, int(rng.integers(3, 10))).tolist()
        samples.append(
            SampleArrays.from_proto(
                pb.Sample(
                    sample_id=f"e{i // 2}/1/{i % 2}",
                    episode_id=f"e{i // 2}",
                    token_ids=prompt + completion,
                    loss_mask=[False] * len(prompt) + [True] * len(completion),
                    behavior_logprobs=[0.0] * len(prompt)
                    + rng.uniform(-9, -6, len(completion)).tolist(),
                    advantage=float(rng.normal()),
                    temperature=1.0,
                )
            )
        )
    return samples


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--first-batch", type=int, default=0)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--lora", action="store_true", help="rank-4 adapters, frozen base")
    args = parser.parse_args()
    settings = TrainerSection(
        model=TINY,
        device="cpu",
        lr=1e-3,
        micro_batch_tokens=32,
        sharding={"strategy": args.strategy},
        lora={"rank": 4, "alpha": 8.0} if args.lora else None,
    )
    policy = Policy.load(settings)
    if args.resume is not None:
        policy.load_tensors(args.resume)
    for k in range(args.first_batch, args.first_batch + args.steps):
        policy.step(batch(7 + k))
        if k == args.first_batch and args.save is not None:
            policy.save_tensors(args.save)  # the directory exists: rank 0 made it below
        weights = {name: full(t).detach().clone() for name, t in policy.model.state_dict().items()}
        if policy.world.leader:
            save_file(weights, str(args.out / f"step-{k + 1}.safetensors"))
    if policy.world.leader:
        print(f"sharded={policy.sharded} world={policy.world.size}")
    policy.world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
