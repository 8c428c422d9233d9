"""`harnessrl bench ...`: benchmarks that print JSON figures (code in bench/)."""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnessrl.command import add_kafka_options


@dataclass(frozen=True, slots=True)
class Benchmark:
    """One `harnessrl bench` subcommand: its module in bench/ (whose `main(args)` runs it)
    and the function that adds its options."""

    name: str
    module: str
    help: str
    description: str
    arguments: Callable[[argparse.ArgumentParser], None]


def register(commands: Any) -> None:
    parser = commands.add_parser("bench", help="run a benchmark and print JSON figures")
    sub = parser.add_subparsers(title="benchmarks", metavar="BENCHMARK")
    for benchmark in BENCHMARKS:
        command = sub.add_parser(
            benchmark.name, help=benchmark.help, description=benchmark.description
        )
        benchmark.arguments(command)
        command.set_defaults(run=functools.partial(_run, benchmark.module))
    parser.set_defaults(run=lambda _: parser.print_help() or 2)


def _run(module: str, args: argparse.Namespace) -> int:
    if module == "trainer" and args.sharded:
        module = "trainer_sharded"
    main: Callable[[argparse.Namespace], int] = importlib.import_module(
        f"harnessrl.bench.{module}"
    ).main
    return main(args)


def _json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


def _bus_arguments(bus: argparse.ArgumentParser) -> None:
    _json(bus)
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


def _inference_arguments(inference: argparse.ArgumentParser) -> None:
    _json(inference)
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


def _weights_arguments(weights: argparse.ArgumentParser) -> None:
    _json(weights)
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


def _samples_arguments(samples: argparse.ArgumentParser) -> None:
    _json(samples)
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


def _reward_arguments(reward: argparse.ArgumentParser) -> None:
    _json(reward)
    reward.add_argument("--tasks", type=Path, required=True, help="swe task file (JSONL)")
    reward.add_argument(
        "--limit", type=int, default=0, help="first N tasks with a test command (default all)"
    )
    reward.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds; medians (default 3)"
    )


def _trainer_arguments(trainer: argparse.ArgumentParser) -> None:
    _json(trainer)
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


def _load_arguments(load: argparse.ArgumentParser) -> None:
    _json(load)
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


def _gateway_arguments(gateway: argparse.ArgumentParser) -> None:
    _json(gateway)
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
    gateway.add_argument(
        "--log-level",
        default="INFO",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="the gateway's log level (default INFO, its own default: the access line of "
        "every call is part of what it costs)",
    )


def _own_arguments(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """Options a benchmark module declares itself (`add_arguments`: standard library and
    orjson only at import)."""

    def add(parser: argparse.ArgumentParser) -> None:
        importlib.import_module(f"harnessrl.bench.{module}").add_arguments(parser)

    return add


BENCHMARKS = (
    Benchmark(
        "bus",
        "bus",
        "bus producer->consumer throughput and latency vs raw aiokafka",
        "Move ModelCall-sized events (2,000 prompt ids, 500 completion ids and log-probs) "
        "producer->consumer through the project's bus and through raw aiokafka with the same "
        "bytes, in the same run, on an embedded broker (or --bootstrap). The last line is one "
        "JSON object.",
        _bus_arguments,
    ),
    Benchmark(
        "inference",
        "inference",
        "engine tokens/s at concurrency 1 and 16",
        "Start `harnessrl inference` on --model in its own process and, through its HTTP API, "
        "keep 1 and then 16 completion requests in flight for --seconds each; print generated "
        "tokens/s for both and the speed-up batching gives. The last line is one JSON object.",
        _inference_arguments,
    ),
    Benchmark(
        "weights",
        "weights",
        "trainer->engine weight transfer: gRPC WeightSync and shared memory vs raw socket and "
        "memcpy",
        "Move a synthetic bf16 state dict from this process (the trainer) to a separate engine "
        "process over gRPC WeightSync, over the shared-memory path (both with checksums "
        "verified), over a raw loopback TCP socket, and by memcpy, in the same run. Prints "
        "GB/s and ratios; the last line is one JSON object.",
        _weights_arguments,
    ),
    Benchmark(
        "gateway",
        "gateway",
        "latency the gateway adds and calls/s through it (capture on)",
        "A load generator against a stand-in engine (canned vLLM-shaped answers), directly and "
        "through `harnessrl gateway` capturing to an embedded broker, at concurrency 1, 16 and "
        "64 in alternating runs; then a soak through the gateway measuring its resident memory. "
        "The last line is one JSON object.",
        _gateway_arguments,
    ),
    Benchmark(
        "http",
        "http",
        "the gateway's HTTP stack vs uvicorn+httpx, FastAPI and aiohttp on its proxy workload",
        "One stand-in engine and one proxy per HTTP stack (this package's server and client, "
        "as the gateway runs them; uvicorn + httpx; FastAPI on uvicorn + httpx; aiohttp server "
        "+ client), each forwarding ~1 kB chat calls to the engine; a load generator at "
        "concurrency 1, 16 and 64 straight at the engine and through each proxy, in the same "
        "run. Prints latency, requests/s and CPU per request of each process, and harnessrl's "
        "ratios against each stack; the last line is one JSON object.",
        _own_arguments("http"),
    ),
    Benchmark(
        "http-memory",
        "http_memory",
        "the HTTP server's memory under stalled large uploads, and after them",
        "64 connections each send all but one byte of a maximal body and stall, twice, against "
        "the project's HTTP server in a child process with its default buffered-bytes budget; "
        "prints its RSS at the start, at each peak and after each round (the goal: back within "
        "50 MB of the start). The last line is one JSON object.",
        _own_arguments("http_memory"),
    ),
    Benchmark(
        "load",
        "load",
        "concurrent demo-harness episodes through the gateway: errors, p99 latency",
        "Keep --episodes episodes of the calculator demo harness (its own solve() with the real "
        "openai SDK, the episode token as API key) running for --seconds through `harnessrl "
        "gateway` capturing to an embedded broker, against a stand-in engine; each episode is "
        "closed at the gateway's admin API as the controller does. Counts errors (any non-2xx "
        "or exception the harness sees, failed closes, calls missing from hrl.calls) and "
        "client-side latency, beside a baseline of the same load straight against the "
        "stand-in. The last line is one JSON object; the exit status is 1 when there were "
        "errors.",
        _load_arguments,
    ),
    Benchmark(
        "samples",
        "samples",
        "sample builder tokens/s (bytes in -> GroupSamples bytes out) vs np.concatenate",
        "Build synthetic groups (episodes of growing agent conversations, as serialised events) "
        "into GroupSamples through the sample builder's join and build, and concatenate the "
        "same ids as numpy arrays, alternating, in the same run. Prints tokens/s of both and "
        "their ratio; the last line is one JSON object.",
        _samples_arguments,
    ),
    Benchmark(
        "reward",
        "reward",
        "builtin:tests seconds per scored patch vs the bare test run",
        "For each task of a swe task file (`harnessrl swe synth` output), score its gold patch "
        "and a patch that fixes nothing with builtin:tests, and, in the same run, apply each "
        "patch to a clone and run the task's test command directly (no rules, no containment). "
        "Prints seconds per patch for both and their ratio; the last line is one JSON object.",
        _reward_arguments,
    ),
    Benchmark(
        "trainer",
        "trainer",
        "trainer optimiser-step time vs a bare PyTorch loop, same batches and model",
        "Train two copies of the same model on the same seeded batches, alternating: one "
        "through the trainer's Policy.step (weights, packing, clipped loss, stats, clipping, "
        "AdamW), one through a bare forward/log_softmax/backward/AdamW loop over the same "
        "micro-batches. Prints step seconds, their ratio, tokens/s (and MFU on CUDA); the last "
        "line is one JSON object.",
        _trainer_arguments,
    ),
    Benchmark(
        "baseline",
        "session_baseline",
        "production sessions' baselines: policy-gradient variance, bias and convergence",
        "Simulate production sessions of several kinds (rewards 0/1 or thumbs, noise, decided "
        "hours later out of order) under a softmax policy whose score function is known, and "
        "compare the estimators of a session's advantage (none, one global running mean, the "
        "per-(app, kind) running baseline with and without scale, a cohort leave-one-out "
        "mean): the variance of the per-session gradient estimate and its ratio to none's, "
        "its bias against the true gradient, and the success rate a policy-gradient loop "
        "reaches with each. numpy, seeded, seconds. The last line is one JSON object.",
        _own_arguments("session_baseline"),
    ),
    Benchmark(
        "canary",
        "canary",
        "the canary rule: false rollbacks and promotions, power, sessions to a decision",
        "Simulate canaries (0/1 rewards, error and no-answer guards; the candidate equal, worse "
        "by exactly the margin, harmful, helpful, or harmful only in its error rate), checking "
        "trust/canary.py's promote/rollback rule after every session: the share of runs "
        "promoted, rolled back and undecided, the share decided rightly, the median sessions "
        "to a decision. numpy, seeded, seconds. The last line is one JSON object.",
        _own_arguments("canary"),
    ),
    Benchmark(
        "sessions",
        "sessions",
        "production sessions through the real services: sessions/s, signals/s, memory",
        "Start the embedded broker, a stand-in engine and `harnessrl gateway`, `reward` and "
        "`sample-builder` with one production app; drive --sessions sessions (one chat call "
        "naming the session, then its end) through the gateway until the reward service holds "
        "them all awaiting feedback; read each process's peak and current memory with a tenth "
        "and with all of them waiting; send one feedback signal per session until every reward "
        "is published and every session built; last, a baseline of controller episodes (one "
        "call and a close) through the same gateway. The last line is one JSON object.",
        _own_arguments("sessions"),
    ),
)
