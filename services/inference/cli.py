"""`harnessrl inference` and `harnessrl vllm-sync`: command-line flags (imports nothing heavy)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harnessrl.command import CliError, add_kafka_options, load, module_main, serve_service


def register(commands: Any) -> None:
    _register_inference(commands)
    _register_vllm_sync(commands)


def _register_inference(commands: Any) -> None:
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
    _add_follow(parser)
    add_kafka_options(parser)
    parser.set_defaults(run=run)


def _add_follow(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--follow",
        choices=["newest", "stable", "candidate"],
        help="full weights during a canary rollout: the version served (default newest)",
    )


def run(args: argparse.Namespace) -> int:
    from harnessrl.services.inference.config import InferenceConfig
    from harnessrl.services.inference.service import InferenceService

    flags = {
        "model": args.model,
        "host": args.host,
        "port": args.port,
        "device": args.device,
        "max_batch": args.max_batch,
        "served_model_name": args.served_model_name,
        "follow": args.follow,
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
    return serve_service(
        "inference",
        config,
        config.inference,
        lambda rt: InferenceService(config, rt),
        health_endpoint=False,
    )


def _register_vllm_sync(commands: Any) -> None:
    parser = commands.add_parser(
        "vllm-sync",
        help="drive a vLLM server's weight swaps from hrl.policy",
        description="Follow hrl.policy for one `vllm serve` (VLLM_SERVER_DEV_MODE=1, with the "
        "worker extension harnessrl.weights.vllm_worker.WeightSyncWorkerExtension): load each "
        "new policy version into it over WeightSync (pause, stage, commit, resume), publish "
        "PolicyLoaded under the engine name the gateway uses for it, and load the newest "
        "version again when vLLM restarts on its initial weights.",
    )
    parser.add_argument(
        "--vllm-url", metavar="URL", help="root URL of the vLLM server, e.g. http://vllm:8100"
    )
    parser.add_argument(
        "--engine-name",
        metavar="URL",
        help="its name in PolicyLoaded: the URL the gateway has for it (default --vllm-url)",
    )
    parser.add_argument(
        "--pause-mode",
        choices=["keep", "wait", "abort"],
        help="what vLLM does with requests in flight during a swap (default keep)",
    )
    parser.add_argument("--host", help="interface of /healthz and /metrics (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port of /healthz and /metrics (default 8250)")
    _add_follow(parser)
    add_kafka_options(parser)
    parser.set_defaults(run=run_vllm_sync)


def run_vllm_sync(args: argparse.Namespace) -> int:
    from harnessrl.services.inference.config import VllmSyncConfig
    from harnessrl.services.inference.vllm_sync import VllmSyncService

    flags = {
        "vllm_url": args.vllm_url,
        "engine_name": args.engine_name,
        "pause_mode": args.pause_mode,
        "host": args.host,
        "port": args.port,
        "follow": args.follow,
    }
    config = load(VllmSyncConfig, args, vllm_sync={k: v for k, v in flags.items() if v is not None})
    if config.vllm_sync.vllm_url is None:
        raise CliError(
            "--vllm-url (vllm_sync.vllm_url, HARNESSRL_VLLM_SYNC__VLLM_URL) is required: "
            "the root URL of the vLLM server, e.g. http://vllm:8100"
        )
    return serve_service(
        "vllm-sync", config, config.vllm_sync, lambda rt: VllmSyncService(config, rt)
    )


def main(argv: list[str] | None = None) -> int:
    return module_main("harnessrl.services.inference", "inference", register, argv)
