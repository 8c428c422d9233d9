"""Trainer steps on fixed batches in one process or under torchrun, every scenario of
tests/integration/test_trainer_sharded.py in one launch (starting torch is most of the
cost). Rank 0 writes the full weights after each step to OUT/<scenario>-step-<k>.safetensors.

    sharded_step.py OUT [--resume DIR]
        full weights (2 steps; under torchrun the default FSDP, saved after step 1 to
        OUT/saved), LoRA (1 step; saved to OUT/lora-saved under torchrun); under torchrun
        also `resumed` (OUT/saved loaded into a fresh sharded policy, then step 2) and
        `replicate` (1 step, whole copies); with --resume, `resumed` from DIR (step 2)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.torch import save_file

from harnessrl.services.trainer.config import TrainerSection
from harnessrl.services.trainer.policy import Policy
from harnessrl.services.trainer.sharding import full
from harnessrl.trust.packing import SampleArrays
from harnessrl.v1 import events_pb2 as pb

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-model"


def batch(step: int) -> list[SampleArrays]:
    """The batch of step `step` (1, 2, ...): seven samples, so ranks get unequal shares."""
    rng = np.random.default_rng(6 + step)
    samples = []
    for i in range(7):
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


def policy(**overrides: Any) -> Policy:
    settings = {"model": TINY, "device": "cpu", "lr": 1e-3, "micro_batch_tokens": 32}
    return Policy.load(TrainerSection.model_validate(settings | overrides))


def step(trained: Policy, k: int, out: Path, scenario: str) -> None:
    trained.step(batch(k))
    weights = {name: full(t).detach().clone() for name, t in trained.model.state_dict().items()}
    if trained.world.leader:
        save_file(weights, str(out / f"{scenario}-step-{k}.safetensors"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", type=Path)
    args = parser.parse_args()
    out: Path = args.out
    first = policy()
    ranks = first.world.size
    step(first, 1, out, "full")
    if ranks > 1:
        first.save_tensors(out / "saved")
    step(first, 2, out, "full")
    lora = policy(lora={"rank": 4, "alpha": 8.0})
    step(lora, 1, out, "lora")
    if ranks > 1:
        lora.save_tensors(out / "lora-saved")
        resumed = policy()
        resumed.load_tensors(out / "saved")
        step(resumed, 2, out, "resumed")
        step(policy(sharding={"strategy": "replicate"}), 1, out, "replicate")
    if args.resume is not None:
        resumed = policy()
        resumed.load_tensors(args.resume)
        step(resumed, 2, out, "resumed")
    print(f"world={ranks} sharded={first.sharded}")
    first.world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
