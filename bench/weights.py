"""`harnessrl bench weights`: policy weights from a trainer to an engine process, four ways.

The bench process plays the trainer: it builds a synthetic bf16 state dict (Llama-shaped
tensors, `--size-mb` in all) and publishes it on a WeightSyncServer with shared memory on.
A separate engine process (multiprocessing, spawn) receives the same bytes:

- grpc: WeightSyncClient.fetch(use_shm=False), checksums verified as in production;
- shm: WeightSyncClient.fetch(use_shm=True) through the version's shared-memory segment,
  the same verification included;
- socket: the tensors' bytes sent with plain sendall over loopback TCP, received with
  recv_into into one preallocated buffer (no framing, no verification: a floor);
- memcpy: the received bytes copied in memory into a preallocated buffer (torch copy_, the
  primitive the shm path uses), in the engine process.

The engine calls harnessrl.weights.tune_malloc() first (as an inference engine should;
`--no-tune-malloc` shows the difference). The first grpc and shm fetches write into freshly
allocated tensors and are reported apart (`*_first_gbps`); the measured repetitions then
reuse those tensors (`fetch(out=...)`), as an engine double-buffering its weights does, just
as the socket and memcpy paths reuse their buffers. Each round runs every path once (the
order rotating); GB/s figures are medians over rounds, and each ratio is the median of the
per-round ratios. GB/s are 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import orjson

MiB = 1024 * 1024
PATHS = ("grpc", "shm", "socket", "memcpy")
GOALS = {"grpc_vs_socket": 0.6, "shm_vs_memcpy": 0.5}


def _log(line: str) -> None:
    print(f"bench weights: {line}", file=sys.stderr, flush=True)


def _layer_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    inter = max(64, hidden * 43 // 16 // 64 * 64)  # Llama's ~2.7x MLP width
    return {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (hidden, hidden),
        "self_attn.v_proj.weight": (hidden, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }


def _layer_size(hidden: int) -> int:
    return sum(math.prod(shape) for shape in _layer_shapes(hidden).values())


def synthetic_state_dict(size_bytes: int, seed: int = 0) -> dict[str, Any]:
    """bf16 tensors shaped like a Llama-style decoder, `size_bytes` in all (within ~0.1%).

    The hidden size is the largest that lets eight layers fit; layers take about three
    quarters of the bytes and the vocabulary is sized to fill the rest. Values are tiled
    from a random block: as good as fresh random numbers for moving bytes, and faster.
    """
    import torch

    budget = size_bytes // 2  # bf16 elements
    hidden = next(
        (h for h in (4096, 2048, 1024, 512, 256, 128) if 8 * _layer_size(h) <= budget), 64
    )
    layers = max(1, budget * 3 // 4 // _layer_size(hidden))
    vocab = max(1, (budget - layers * _layer_size(hidden) - hidden) // (2 * hidden))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({f"model.layers.{i}.{k}": v for k, v in _layer_shapes(hidden).items()})
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    generator = torch.Generator().manual_seed(seed)
    block = torch.randn(2 * 4 * MiB, dtype=torch.bfloat16, generator=generator)
    half = block.numel() // 2
    state: dict[str, Any] = {}
    for n, (name, shape) in enumerate(shapes.items()):
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        flat, start = tensor.view(-1), (n * 7919) % half
        for i in range(0, flat.numel(), half):
            part = flat[i : i + half]
            part.copy_(block[start : start + part.numel()])
        state[name] = tensor
    return state


async def _engine_loop(conn: Connection, address: str, chunk_bytes: int | None) -> None:
    import torch

    from harnessrl.weights import WeightSyncClient
    from harnessrl.weights.client import DEFAULT_REQUEST_CHUNK_BYTES

    loop = asyncio.get_running_loop()
    staging: dict[str, torch.Tensor] | None = None
    received: bytearray | None = None
    copy_target: torch.Tensor | None = None
    peer: socket.socket | None = None
    chunk = DEFAULT_REQUEST_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    async with WeightSyncClient(address, max_chunk_bytes=chunk) as client:
        while True:
            command, *params = await loop.run_in_executor(None, conn.recv)
            if command == "stop":
                break
            if command in ("grpc", "shm"):
                version, fresh = params
                out = None if fresh else staging
                result = await client.fetch(version, use_shm=command == "shm", out=out)
                if result.transport != command:
                    raise RuntimeError(f"asked for {command}, fetched over {result.transport}")
                staging = staging or result.state_dict  # the first result is reused after
                conn.send(result.seconds)
            elif command == "socket":
                port, nbytes = params
                if peer is None:
                    peer = socket.create_connection(("127.0.0.1", port))
                    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    received = bytearray(nbytes)
                    torch.frombuffer(received, dtype=torch.uint8).fill_(1)  # map every page
                assert received is not None
                conn.send(_receive(peer, memoryview(received)))
            elif command == "memcpy":
                assert received is not None
                source = torch.frombuffer(received, dtype=torch.uint8)
                if copy_target is None:
                    copy_target = torch.zeros_like(source)
                started = time.perf_counter()
                copy_target.copy_(source)
                conn.send(time.perf_counter() - started)
    if peer is not None:
        peer.close()


def _receive(peer: socket.socket, buffer: memoryview) -> float:
    started = time.perf_counter()
    peer.sendall(b"g")
    got = 0
    while got < len(buffer):
        n = peer.recv_into(buffer[got:], min(len(buffer) - got, 16 * MiB))
        if n == 0:
            raise ConnectionError("the bench closed the socket early")
        got += n
    return time.perf_counter() - started


def _engine(conn: Connection, address: str, chunk_bytes: int | None, tune: bool) -> None:
    """The engine process: executes the bench's commands, answers with seconds."""
    from harnessrl.weights import tune_malloc

    tuned = tune_malloc() if tune else False
    conn.send(tuned)
    asyncio.run(_engine_loop(conn, address, chunk_bytes))


def _serve_socket(listener: socket.socket, views: list[memoryview], stop: threading.Event) -> None:
    """Send all tensors' bytes each time the engine asks (one byte), until it hangs up."""
    peer, _ = listener.accept()
    with peer:
        peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while not stop.is_set() and peer.recv(1):
            for view in views:
                peer.sendall(view)


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from harnessrl.weights import DEFAULT_ALGORITHM, WeightSyncServer, WeightSyncSettings
    from harnessrl.weights.client import DEFAULT_REQUEST_CHUNK_BYTES
    from harnessrl.weights.manifest import byte_view

    started = time.perf_counter()
    state = synthetic_state_dict(int(args.size_mb * MiB))
    total = sum(t.numel() * t.element_size() for t in state.values())
    built_s = time.perf_counter() - started
    _log(f"{len(state)} bf16 tensors, {total / 1e9:.3f} GB, built in {built_s:.1f}s")
    server = WeightSyncServer(WeightSyncSettings(port=0, shared_memory=True))
    await server.start()
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    sender = threading.Thread(
        target=_serve_socket,
        args=(listener, [byte_view(t) for t in state.values()], stop),
        daemon=True,  # blocked in accept() if the engine never connects
    )
    sender.start()
    chunk_bytes = None if args.chunk_mb is None else int(args.chunk_mb * MiB)
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    engine = ctx.Process(
        target=_engine, args=(child_conn, server.address, chunk_bytes, not args.no_tune_malloc)
    )
    engine.start()
    child_conn.close()  # so a crashed engine shows up as EOFError, not a hang
    loop = asyncio.get_running_loop()

    async def ask(*command: Any) -> Any:
        conn.send(command)
        return await loop.run_in_executor(None, conn.recv)

    try:
        tuned = await loop.run_in_executor(None, conn.recv)
        started = time.perf_counter()
        await server.publish(1, 1, state)
        publish_s = time.perf_counter() - started
        _log(f"published with checksums and shared memory in {publish_s:.2f}s")
        first = {p: total / await ask(p, 1, True) / 1e9 for p in ("grpc", "shm")}
        _log(
            f"first fetches (fresh tensors): grpc {first['grpc']:.2f} GB/s, "
            f"shm {first['shm']:.2f} GB/s"
        )
        gbps: dict[str, list[float]] = {p: [] for p in PATHS}
        for r in range(args.repetitions):
            for path in PATHS[r % 4 :] + PATHS[: r % 4]:
                params = {
                    "grpc": (1, False),  # version 1, into the tensors of the first fetch
                    "shm": (1, False),
                    "socket": (listener.getsockname()[1], total),
                    "memcpy": (),
                }[path]
                gbps[path].append(total / await ask(path, *params) / 1e9)
            _log(
                f"round {r + 1}/{args.repetitions}: "
                + ", ".join(f"{p} {gbps[p][-1]:.2f} GB/s" for p in PATHS)
            )
        conn.send(("stop",))
    finally:
        stop.set()
        conn.close()  # an engine still waiting for a command gets EOFError and exits
        await loop.run_in_executor(None, engine.join, 60)
        if engine.is_alive():
            engine.kill()
        listener.close()
        sender.join(5)
        await server.stop()
    grpc_gbps, shm_gbps, socket_gbps, memcpy_gbps = (statistics.median(gbps[p]) for p in PATHS)
    ratios = {
        "grpc_vs_socket": _paired_ratio(gbps["grpc"], gbps["socket"]),
        "shm_vs_memcpy": _paired_ratio(gbps["shm"], gbps["memcpy"]),
    }
    return {
        "size_bytes": total,
        "size_mb": round(total / MiB, 1),
        "tensors": len(state),
        "repetitions": args.repetitions,
        "chunk_bytes": chunk_bytes or DEFAULT_REQUEST_CHUNK_BYTES,
        "checksum": DEFAULT_ALGORITHM,
        "malloc_tuned": tuned,
        "publish_s": round(publish_s, 3),
        "grpc_gbps": round(grpc_gbps, 3),
        "shm_gbps": round(shm_gbps, 3),
        "socket_gbps": round(socket_gbps, 3),
        "memcpy_gbps": round(memcpy_gbps, 3),
        "grpc_first_gbps": round(first["grpc"], 3),
        "shm_first_gbps": round(first["shm"], 3),
        **ratios,
        "goals": GOALS,
        "goals_met": all(ratios[k] >= v for k, v in GOALS.items()),
    }


def _paired_ratio(ours: list[float], baseline: list[float]) -> float:
    """Median over rounds of ours/baseline within each round: a slow moment of the shared
    machine hits both sides of a round's ratio, while it can skew separate medians."""
    return round(statistics.median(a / b for a, b in zip(ours, baseline, strict=True)), 3)


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(_measure(args))
    if not args.json:
        for key, value in result.items():
            print(f"{key:>16}: {value}")
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
    return 0
