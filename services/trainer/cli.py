"""`harnessrl trainer` (imports nothing heavy).

Under `torchrun --nproc-per-node N -m harnessrl.services.trainer`, rank 0 is the service
(Kafka, checkpoints, WeightSync) and the other ranks follow it: they receive each batch,
train on their share of it, and take part in the gradient all-reduce.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from harnessrl.cli.common import CliError, add_kafka_options, load


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "trainer",
        help="run the trainer (GroupSamples -> policy-gradient steps -> new weights)",
        description="Consume GroupSamples from hrl.samples, take PPO-clip policy-gradient "
        "steps on the recorded tokens, checkpoint, serve each new version over WeightSync "
        "and announce it on hrl.policy. Multi-process: torchrun --nproc-per-node N -m "
        "harnessrl.services.trainer.",
    )
    parser.add_argument("--model", metavar="DIR", help="initial policy (trainer.model)")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="trainer.checkpoint_dir")
    parser.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help="train N steps, then exit (trainer.max_steps; trainer.at_max_steps: serve keeps "
        "serving the last version instead)",
    )
    add_kafka_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.services.trainer.config import TrainerConfig

    flags = {
        "model": args.model,
        "checkpoint_dir": args.checkpoint_dir,
        "max_steps": args.max_steps,
    }
    config = load(TrainerConfig, args, trainer={k: v for k, v in flags.items() if v})
    if int(os.environ.get("RANK", "0")) != 0:
        return _follow(config)
    from harnessrl.runtime import serve

    try:
        return serve("trainer", config, config.trainer, lambda rt: _service(config, rt))
    except ValueError as err:
        raise CliError(str(err)) from None


def _service(config: Any, runtime: Any) -> Any:
    from harnessrl.services.trainer.distributed import World
    from harnessrl.services.trainer.policy import device_for
    from harnessrl.services.trainer.service import TrainerService

    return TrainerService(config, runtime, World.from_env(device_for(config.trainer.device)))


def _follow(config: Any) -> int:
    """A non-leader rank: train on each batch the leader shares, until it shares None."""
    from harnessrl.config import secret_values
    from harnessrl.logs import configure_logging
    from harnessrl.services.trainer.checkpoint import Checkpoints
    from harnessrl.services.trainer.policy import Policy

    configure_logging("trainer", config.log, secrets=secret_values(config))
    policy = Policy.load(config.trainer)
    checkpoints = Checkpoints(config.trainer.checkpoint_dir, keep=config.trainer.keep_checkpoints)
    latest = checkpoints.latest()
    if latest is not None:  # the leader resumes from the same one
        checkpoints.load(latest, policy.model, policy.optimizer, policy.scheduler)
    while (samples := policy.world.share(None)) is not None:
        policy.step(samples)
    policy.world.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harnessrl.services.trainer")
    register(parser.add_subparsers())
    args = parser.parse_args(["trainer", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.run(args)
    return code
