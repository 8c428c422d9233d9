"""`harnessrl bench ...`: benchmarks that print JSON figures (code in bench/)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from harnessrl.command import add_kafka_options


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="run a benchmark and print JSON figures")
    sub = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    bus = sub.add_parser(
        "bus",
        help="bus producer->consumer throughput and latency vs raw aiokafka",
        description="Move ModelCall-sized events (2,000 prompt ids, 500 completion ids and "
        "log-probs) producer->consumer through the project's bus and through raw aiokafka "
        "with the same bytes, in the same run, on an embedded broker (or --bootstrap). "
        "The last line is one JSON object.",
    )
    bus.add_argument("--json", action="store_true", help="print only the JSON result line")
    bus.add_argument(
        "--events", type=int, default=5000, help="events per throughput run (default 5000)"
    )
    bus.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternating bus/raw rounds; the median is reported (default 3)",
    )
    add_kafka_options(bus)
    bus.set_defaults(run=_run_bus)
    inference = sub.add_parser(
        "inference",
        help="engine tokens/s at concurrency 1 and 16",
        description="Start `harnessrl inference` on --model in its own process and, through "
        "its HTTP API, keep 1 and then 16 completion requests in flight for --seconds each; "
        "print generated tokens/s for both and the speed-up batching gives. The last line "
        "is one JSON object.",
    )
    inference.add_argument("--json", action="store_true", help="print only the JSON line")
    inference.add_argument(
        "--model",
        type=Path,
        default=Path("examples/tiny-model"),
        help="model directory (default examples/tiny-model)",
    )
    inference.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        help="seconds of load per concurrency level (default 10)",
    )
    inference.add_argument(
        "--max-tokens", type=int, default=64, help="completion tokens per request (default 64)"
    )
    inference.set_defaults(run=_run_inference)
    weights = sub.add_parser(
        "weights",
        help="trainer->engine weight transfer: gRPC WeightSync and shared memory vs raw "
        "socket and memcpy",
        description="Move a synthetic bf16 state dict from this process (the trainer) to a "
        "separate engine process over gRPC WeightSync, over the shared-memory path (both "
        "with checksums verified), over a raw loopback TCP socket, and by memcpy, in the "
        "same run. Prints GB/s and ratios; the last line is one JSON object.",
    )
    weights.add_argument("--json", action="store_true", help="print only the JSON result line")
    weights.add_argument(
        "--size-mb", type=float, default=1024, help="state dict size in MiB (default 1024)"
    )
    weights.add_argument(
        "--chunk-mb",
        type=float,
        default=None,
        help="gRPC chunk size the engine asks for, in MiB (default: the client's, 1)",
    )
    weights.add_argument(
        "--repetitions",
        type=int,
        default=7,
        help="rounds over all four paths; medians are reported (default 7)",
    )
    weights.add_argument(
        "--no-tune-malloc",
        action="store_true",
        help="leave glibc malloc at its defaults in the engine process",
    )
    weights.set_defaults(run=_run_weights)
    _register_gateway(sub)
    _register_http_memory(sub)
    _register_load(sub)
    samples = sub.add_parser(
        "samples",
        help="sample builder tokens/s (bytes in -> GroupSamples bytes out) vs np.concatenate",
        description="Build synthetic groups (episodes of growing agent conversations, as "
        "serialised events) into GroupSamples through the sample builder's join and build, "
        "and concatenate the same ids as numpy arrays, alternating, in the same run. Prints "
        "tokens/s of both and their ratio; the last line is one JSON object.",
    )
    samples.add_argument("--json", action="store_true", help="print only the JSON line")
    samples.add_argument("--groups", type=int, default=20, help="groups per round (default 20)")
    samples.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="alternating builder/concat rounds; medians reported (default 5)",
    )
    samples.add_argument("--episodes", type=int, default=8, help="episodes per group (default 8)")
    samples.add_argument("--calls", type=int, default=8, help="calls per episode (default 8)")
    samples.add_argument("--seed", type=int, default=0, help="seed of the groups (default 0)")
    samples.set_defaults(run=_run_samples)
    reward = sub.add_parser(
        "reward",
        help="builtin:tests seconds per scored patch vs the bare test run",
        description="For each task of a swe task file (`harnessrl swe synth` output), score "
        "its gold patch and a patch that fixes nothing with builtin:tests, and, in the same "
        "run, apply each patch to a clone and run the task's test command directly (no "
        "rules, no containment). Prints seconds per patch for both and their ratio; the "
        "last line is one JSON object.",
    )
    reward.add_argument("--json", action="store_true", help="print only the JSON line")
    reward.add_argument("--tasks", type=Path, required=True, help="swe task file (JSONL)")
    reward.add_argument(
        "--limit", type=int, default=0, help="first N tasks with a test command (default all)"
    )
    reward.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds; medians (default 3)"
    )
    reward.set_defaults(run=_run_reward)
    _register_trainer(sub)
    parser.set_defaults(run=lambda _: parser.print_help() or 2)


def _register_trainer(sub: Any) -> None:
    trainer = sub.add_parser(
        "trainer",
        help="trainer optimiser-step time vs a bare PyTorch loop, same batches and model",
        description="Train two copies of the same model on the same seeded batches, "
        "alternating: one through the trainer's Policy.step (weights, packing, clipped loss, "
        "stats, clipping, AdamW), one through a bare forward/log_softmax/backward/AdamW loop "
        "over the same micro-batches. Prints step seconds, their ratio, tokens/s (and MFU on "
        "CUDA); the last line is one JSON object.",
    )
    trainer.add_argument("--json", action="store_true", help="print only the JSON line")
    trainer.add_argument(
        "--model-size",
        choices=("tiny", "0.5b"),
        default="tiny",
        help="tiny: --model (default); 0.5b: a random Qwen2.5-0.5B-shaped model (CUDA only)",
    )
    trainer.add_argument(
        "--model",
        type=Path,
        default=Path("examples/tiny-model"),
        help="model directory under --model-size tiny (default examples/tiny-model)",
    )
    trainer.add_argument(
        "--model-config",
        type=Path,
        default=None,
        help="instead of --model: a random model of the architecture this config.json (or "
        "directory holding one) describes, e.g. examples/configs/qwen3-1.5b-shape",
    )
    trainer.add_argument(
        "--lora", action="store_true", help="train LoRA adapters (both sides) on a frozen base"
    )
    trainer.add_argument("--lora-rank", type=int, default=16, help="--lora: rank (default 16)")
    trainer.add_argument(
        "--batches",
        type=int,
        default=6,
        help="batches; the first is a warm-up, medians of the rest (default 6)",
    )
    trainer.add_argument("--samples", type=int, default=16, help="samples per batch (default 16)")
    trainer.add_argument(
        "--min-len", type=int, default=None, help="shortest sample (default 64; 0.5b: 256)"
    )
    trainer.add_argument(
        "--max-len", type=int, default=None, help="longest sample (default 256; 0.5b: 1024)"
    )
    trainer.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="padded tokens per micro-batch (default 2048; 0.5b: 16384)",
    )
    trainer.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="default auto"
    )
    trainer.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="accelerator peak TFLOPs for MFU (default 989: H100/H200 bf16 dense)",
    )
    trainer.add_argument("--seed", type=int, default=0, help="seed of the batches (default 0)")
    trainer.add_argument(
        "--sharded",
        action="store_true",
        help="instead: one process vs torchrun --ranks ranks under FSDP2 on --model, same "
        "steps: state bytes per rank (parameters, gradients, AdamW), peak memory, the "
        "largest weight difference",
    )
    trainer.add_argument(
        "--ranks", type=int, default=2, help="--sharded: torchrun ranks (default 2)"
    )
    trainer.set_defaults(run=_run_trainer)


def _register_load(sub: Any) -> None:
    load = sub.add_parser(
        "load",
        help="concurrent demo-harness episodes through the gateway: errors, p99 latency",
        description="Keep --episodes episodes of the calculator demo harness (its own solve() "
        "with the real openai SDK, the episode token as API key) running for --seconds "
        "through `harnessrl gateway` capturing to an embedded broker, against a stand-in "
        "engine; each episode is closed at the gateway's admin API as the controller does. "
        "Counts errors (any non-2xx or exception the harness sees, failed closes, calls "
        "missing from hrl.calls) and client-side latency, beside a baseline of the same "
        "load straight against the stand-in. The last line is one JSON object; the exit "
        "status is 1 when there were errors.",
    )
    load.add_argument("--json", action="store_true", help="print only the JSON line")
    load.add_argument("--episodes", type=int, default=256, help="concurrent episodes (default 256)")
    load.add_argument(
        "--gateways",
        type=int,
        default=1,
        metavar="N",
        help="gateway replicas, each episode at the one that owns it (default 1)",
    )
    load.add_argument(
        "--seconds", type=float, default=120.0, help="seconds through the gateway (default 120)"
    )
    load.add_argument(
        "--baseline-seconds",
        type=float,
        default=10.0,
        help="seconds of the same load straight against the stand-in (default 10)",
    )
    load.set_defaults(run=_run_load)


def _run_bus(args: argparse.Namespace) -> int:
    from harnessrl.bench import bus

    return bus.main(args)


def _run_weights(args: argparse.Namespace) -> int:
    from harnessrl.bench import weights

    return weights.main(args)


def _register_gateway(sub: Any) -> None:
    gateway = sub.add_parser(
        "gateway",
        help="latency the gateway adds and calls/s through it (capture on)",
        description="A load generator against a stand-in engine (canned vLLM-shaped "
        "answers), directly and through `harnessrl gateway` capturing to an embedded broker, "
        "at concurrency 1, 16 and 64 in alternating runs; then a soak through the gateway "
        "measuring its resident memory. The last line is one JSON object.",
    )
    gateway.add_argument("--json", action="store_true", help="print only the JSON line")
    gateway.add_argument("--seconds", type=float, default=4.0, help="seconds per run (default 4)")
    gateway.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs per target and concurrency; medians reported (default 3)",
    )
    gateway.add_argument(
        "--soak-calls", type=int, default=100_000, help="calls in the memory soak (default 100000)"
    )
    gateway.set_defaults(run=_run_gateway)


def _register_http_memory(sub: Any) -> None:
    from harnessrl.bench import http_memory  # standard library and orjson only

    memory = sub.add_parser(
        "http-memory",
        help="the HTTP server's memory under stalled large uploads, and after them",
        description="64 connections each send all but one byte of a maximal body and stall, "
        "twice, against the project's HTTP server in a child process with its default "
        "buffered-bytes budget; prints its RSS at the start, at each peak and after each "
        "round (the goal: back within 50 MB of the start). The last line is one JSON object.",
    )
    http_memory.add_arguments(memory)
    memory.set_defaults(run=_run_http_memory)


def _run_http_memory(args: argparse.Namespace) -> int:
    from harnessrl.bench import http_memory

    return http_memory.main(args)


def _run_gateway(args: argparse.Namespace) -> int:
    from harnessrl.bench import gateway

    return gateway.main(args)


def _run_load(args: argparse.Namespace) -> int:
    from harnessrl.bench import load

    return load.main(args)


def _run_inference(args: argparse.Namespace) -> int:
    from harnessrl.bench import inference

    return inference.main(args)


def _run_samples(args: argparse.Namespace) -> int:
    from harnessrl.bench import samples

    return samples.main(args)


def _run_reward(args: argparse.Namespace) -> int:
    from harnessrl.bench import reward

    return reward.main(args)


def _run_trainer(args: argparse.Namespace) -> int:
    from harnessrl.bench import trainer, trainer_sharded

    if args.sharded:
        return trainer_sharded.main(args)

    return trainer.main(args)
