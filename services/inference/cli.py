"""`harnessrl inference`: command-line flags of the engine (imports nothing heavy)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harnessrl.cli.common import CliError, add_kafka_options, load


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "inference",
        help="run the inference engine (vLLM-compatible OpenAI API)",
        description="Serve a causal LM from a local directory behind OpenAI's chat and "
        "completions APIs in vLLM's dialect (exact token ids, processed log-probs, the policy "
        "version in x-policy-version), batching concurrent requests. With "
        "inference.follow_policy it loads each new policy version from hrl.policy.",
    )
    parser.add_argument(
        "--model", type=Path, metavar="DIR", help="model directory (default examples/tiny-model)"
    )
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (default 8100; 0 picks one)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], help="where to run")
    parser.add_argument("--max-batch", type=int, help="most requests decoding at once")
    parser.add_argument("--served-model-name", help="name clients use in `model`")
    parser.add_argument(
        "--no-follow-policy",
        action="store_true",
        help="serve the weights in --model only; ignore hrl.policy",
    )
    add_kafka_options(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from harnessrl.runtime import serve
    from harnessrl.services.inference.config import InferenceConfig
    from harnessrl.services.inference.service import InferenceService

    flags = {
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "device": args.device,
        "max_batch": args.max_batch,
        "served_model_name": args.served_model_name,
    }
    section = {k: v for k, v in flags.items() if v is not None}
    if args.no_follow_policy:
        section["follow_policy"] = False
    config = load(InferenceConfig, args, inference=section)
    if not config.inference.model.is_dir():
        raise CliError(f"--model: {config.inference.model} is not a directory")
    if config.inference.follow_policy:
        from harnessrl.weights import tune_malloc

        tune_malloc()  # process-wide; big weight pulls run ~2x faster (harnessrl.weights.allocator)
    return serve(
        "inference",
        config,
        config.inference,
        lambda runtime: InferenceService(config, runtime),
        health_endpoint=False,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harnessrl.services.inference")
    register(parser.add_subparsers())
    args = parser.parse_args(["inference", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.run(args)
    return code
