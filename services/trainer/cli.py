"""`harnessrl trainer` (imports nothing heavy).

Under `torchrun --nproc-per-node N -m harnessrl.services.trainer`, rank 0 is the service
(Kafka, checkpoints, WeightSync) and the other ranks follow it: they receive each batch,
train on their share of it, and take part in the gradient all-reduce.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from harnessrl.command import (
    CliError,
    add_config_option,
    add_kafka_options,
    load,
    module_main,
    serve_service,
)


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
    # Without a sub-command `harnessrl trainer [flags]` runs the service, as it always did.
    _register_plan(parser.add_subparsers(title="sub-commands (none: run the trainer)"))


def _register_plan(commands: Any) -> None:
    parser = commands.add_parser(
        "plan",
        help="per-rank memory of a model and trainer configuration, and whether it fits",
        description="Count the model's parameters (built on the meta device: no weights "
        "are read) and estimate the memory per rank of training it: weights, gradients, "
        "AdamW state, FSDP's gathered parameters, activations with and without gradient "
        "checkpointing, the logits, and the total against the GPU's memory less headroom "
        "for the CUDA context and the allocator.",
    )
    parser.add_argument(
        "--model",
        metavar="DIR_OR_CONFIG",
        help="model directory or its config.json (default: trainer.model)",
    )
    parser.add_argument(
        "--gpus", type=int, required=True, metavar="N", help="ranks (torchrun processes)"
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GIB",
        help="memory per GPU in GiB (default: trainer.gpu_memory_gib, else this machine's "
        "GPU, else no verdict)",
    )
    parser.add_argument(
        "--lora", action="store_true", help="train LoRA adapters (trainer.lora; defaults)"
    )
    parser.add_argument("--lora-rank", type=int, metavar="R", help="adapter rank (implies --lora)")
    parser.add_argument(
        "--sharding", choices=("fsdp", "replicate"), help="trainer.sharding.strategy"
    )
    parser.add_argument(
        "--micro-batch-tokens", type=int, metavar="T", help="trainer.micro_batch_tokens"
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="count activations with trainer.gradient_checkpointing on",
    )
    add_config_option(parser)
    parser.add_argument("--json", action="store_true", help="one JSON line (bytes)")
    parser.set_defaults(run=plan)


def plan(args: argparse.Namespace) -> int:
    """`harnessrl trainer plan`: print the memory plan; exit 0 whatever the verdict."""
    from harnessrl.services.trainer.config import TrainerConfig

    overrides: dict[str, Any] = {}
    if args.model:
        overrides["model"] = args.model
    if args.micro_batch_tokens is not None:
        overrides["micro_batch_tokens"] = args.micro_batch_tokens
    if args.gradient_checkpointing:
        overrides["gradient_checkpointing"] = True
    if args.sharding:
        overrides["sharding"] = {"strategy": args.sharding}
    if args.lora or args.lora_rank is not None:
        overrides["lora"] = {} if args.lora_rank is None else {"rank": args.lora_rank}
    if args.gpus < 1:
        raise CliError(f"--gpus: must be at least 1, got {args.gpus}")
    settings = load(TrainerConfig, args, trainer=overrides).trainer
    from harnessrl.services.trainer.memory_estimate import plan
    from harnessrl.services.trainer.memory_plan import format_json, format_plan

    try:
        result = plan(settings.model, settings, args.gpus, _gpu_memory(args, settings))
    except ValueError as err:
        raise CliError(str(err)) from None
    text = format_json(result) if args.json else format_plan(result)
    sys.stdout.write(text + "\n")
    return 0


def _gpu_memory(args: argparse.Namespace, settings: Any) -> int | None:
    gib = args.gpu_memory if args.gpu_memory is not None else settings.gpu_memory_gib
    if gib is not None:
        if gib <= 0:
            raise CliError(f"--gpu-memory: must be positive, got {gib}")
        return int(gib * 1024**3)
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return None


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
    return serve_service("trainer", config, config.trainer, lambda rt: _service(config, rt))


def _service(config: Any, runtime: Any) -> Any:
    from harnessrl.services.trainer.distributed import World
    from harnessrl.services.trainer.policy import device_for
    from harnessrl.services.trainer.service import TrainerService

    return TrainerService(config, runtime, World.from_env(device_for(config.trainer.device)))


def _follow(config: Any) -> int:
    """A non-leader rank: run each command the leader shares (a step, a publication's
    gathers, a checkpoint's save) until it shares None."""
    from harnessrl.config import secret_values
    from harnessrl.logs import configure_logging
    from harnessrl.services.trainer.checkpoint import Checkpoints
    from harnessrl.services.trainer.policy import Policy

    configure_logging("trainer", config.log, secrets=secret_values(config))
    # torchrun passes SIGTERM and SIGINT to every rank; a follower must stay for the
    # leader's final checkpoint (a collective) and stop when the leader says so.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    policy = Policy.load(config.trainer)
    checkpoints = Checkpoints(config.trainer.checkpoint_dir, keep=config.trainer.keep_checkpoints)
    latest = checkpoints.latest()
    if latest is not None:  # the leader resumes from the same one (a collective load)
        checkpoints.load(latest, policy.load_tensors)
    while (command := policy.world.share(None)) is not None:
        policy.follow(command)
    policy.world.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main("harnessrl.services.trainer", "trainer", register, argv)
