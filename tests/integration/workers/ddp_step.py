"""One trainer step on a fixed batch, in one process or under torchrun; rank 0 saves the
updated weights to argv[1]. The test compares the two."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from harnessrl.services.trainer.config import TrainerSection
from harnessrl.services.trainer.packing import SampleArrays
from harnessrl.services.trainer.policy import Policy
from harnessrl.v1 import events_pb2 as pb

TINY = Path(__file__).resolve().parents[3] / "examples" / "tiny-model"


def batch() -> list[SampleArrays]:
    rng = np.random.default_rng(7)
    samples = []
    for i in range(6):
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
    settings = TrainerSection(model=TINY, device="cpu", lr=1e-3, micro_batch_tokens=32)
    policy = Policy.load(settings)
    policy.step(policy.world.share(batch()))
    if policy.world.leader:
        save_file({k: v.clone() for k, v in policy.model.state_dict().items()}, sys.argv[1])
    policy.world.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
