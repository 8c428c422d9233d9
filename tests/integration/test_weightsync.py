"""WeightSync for real: a grpc.aio server and client on loopback, shared memory, faults."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
import torch

from harnessrl.v1 import weights_pb2 as pb
from harnessrl.v1 import weights_pb2_grpc as pb_grpc
from harnessrl.weights import WeightSyncClient, WeightSyncError, WeightSyncServer
from harnessrl.weights import WeightSyncSettings as Settings
from harnessrl.weights.chunks import GRPC_OPTIONS, MiB
from harnessrl.weights.vllm_worker import (
    NotStaged,
    served_versions_http,
    update_weights,
    update_weights_http,
)
from tests.vllm_standin import StandInEngine, StandInVllmServer, StandInWorker
from tests.weight_helpers import FaultInjector, same_bits, state_dict

pytestmark = pytest.mark.integration

Serve = Callable[..., Awaitable[WeightSyncServer]]


def _mappings(segment: str) -> int:
    """How many times this process has shared-memory segment `segment` mapped."""
    return Path("/proc/self/maps").read_text().count(segment)


@pytest_asyncio.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start WeightSyncServers on free loopback ports; all are stopped at the end."""
    servers: list[WeightSyncServer] = []

    async def start(**settings: Any) -> WeightSyncServer:
        server = WeightSyncServer(Settings(port=0, **settings))
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
async def test_grpc_fetch_equals_the_published_state_dict_bit_for_bit(
    serve: Serve, dtype: torch.dtype
) -> None:
    server = await serve()
    state = state_dict(dtype)
    published = await server.publish(5, 50, state)
    async with WeightSyncClient(server.address) as client:
        assert (await client.latest()).version == 5
        result = await client.fetch(5)
    assert result.transport == "grpc"
    assert result.manifest == published
    assert same_bits(result.state_dict, state)


async def test_shared_memory_path_is_used_when_offered_and_unmapped_after(serve: Serve) -> None:
    server = await serve(shared_memory=True)
    state = state_dict()
    manifest = await server.publish(1, 10, state)
    segment = manifest.shm.name
    assert manifest.shm.size >= manifest.total_bytes
    assert (Path("/dev/shm") / segment).exists()
    maps_before = _mappings(segment)  # the server's own
    async with WeightSyncClient(server.address) as client:
        via_shm = await client.fetch(1)
        via_grpc = await client.fetch(1, use_shm=False)
    assert via_shm.transport == "shm"
    assert via_grpc.transport == "grpc"
    assert same_bits(via_shm.state_dict, state)
    assert same_bits(via_grpc.state_dict, state)
    assert _mappings(segment) == maps_before


async def test_a_segment_that_cannot_be_opened_falls_back_to_grpc(serve: Serve) -> None:
    server = await serve(shared_memory=True)
    state = state_dict()
    manifest = await server.publish(1, 10, state)
    os.unlink(Path("/dev/shm") / manifest.shm.name)  # gone, as after an eviction
    async with WeightSyncClient(server.address) as client:
        result = await client.fetch(1)
    assert result.transport == "grpc"
    assert same_bits(result.state_dict, state)


async def test_publishing_then_mutating_the_source_does_not_change_what_is_served(
    serve: Serve,
) -> None:
    server = await serve(shared_memory=True)
    state = state_dict(torch.float32)
    original = {k: v.clone() for k, v in state.items()}
    await server.publish(1, 10, state)
    with torch.no_grad():
        for tensor in state.values():
            tensor.add_(1.0)  # the trainer's next step
    async with WeightSyncClient(server.address) as client:
        for use_shm in (False, True):
            assert same_bits((await client.fetch(1, use_shm=use_shm)).state_dict, original)


async def test_unknown_and_evicted_versions_answer_not_found(serve: Serve) -> None:
    server = await serve(keep_versions=2, shared_memory=True)
    first = await server.publish(1, 10, state_dict())
    await server.publish(2, 20, state_dict(seed=1))
    await server.publish(3, 30, state_dict(seed=2))
    assert server.versions == [2, 3]
    assert not (Path("/dev/shm") / first.shm.name).exists()
    async with WeightSyncClient(server.address) as client:
        for version in (1, 99):
            with pytest.raises(grpc.RpcError) as error:
                await client.fetch(version)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND
            assert f"weights version {version} is not held (held: [2, 3])" in str(
                error.value.details()
            )
    async with grpc.aio.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            async for _ in pb_grpc.WeightSyncStub(channel).Fetch(pb.FetchRequest(version=1)):
                pass
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


async def test_latest_before_anything_is_published_fails_its_precondition(serve: Serve) -> None:
    server = await serve()
    async with WeightSyncClient(server.address) as client:
        with pytest.raises(grpc.RpcError) as error:
            await client.latest()
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_versions_must_increase(serve: Serve) -> None:
    server = await serve()
    await server.publish(4, 40, state_dict())
    with pytest.raises(ValueError, match="version 4 is not newer than the latest published"):
        await server.publish(4, 41, state_dict())


async def _raw_chunks(address: str, version: int, max_chunk_bytes: int) -> list[pb.WeightChunk]:
    async with grpc.aio.insecure_channel(address, options=list(GRPC_OPTIONS)) as channel:
        request = pb.FetchRequest(version=version, max_chunk_bytes=max_chunk_bytes)
        return [c async for c in pb_grpc.WeightSyncStub(channel).Fetch(request)]


async def test_fetch_honours_a_small_max_chunk_bytes_in_manifest_and_offset_order(
    serve: Serve,
) -> None:
    server = await serve()
    state = state_dict()
    manifest = await server.publish(1, 10, state)
    chunks = await _raw_chunks(server.address, 1, 1000)
    assert max(len(c.data) for c in chunks) == 1000
    expected = [
        (spec.name, offset) for spec in manifest.tensors for offset in range(0, spec.nbytes, 1000)
    ]
    assert [(c.tensor, c.offset) for c in chunks] == expected
    async with WeightSyncClient(server.address, max_chunk_bytes=1000) as client:
        assert same_bits((await client.fetch(1)).state_dict, state)


async def test_chunks_default_to_4_mib_and_16_mib_chunks_pass_the_message_limits(
    serve: Serve,
) -> None:
    server = await serve()
    state = {"big": torch.zeros(18 * MiB // 2, dtype=torch.bfloat16).fill_(1.5)}
    await server.publish(1, 1, state)
    default = await _raw_chunks(server.address, 1, 0)
    assert [len(c.data) for c in default] == [4 * MiB] * 4 + [2 * MiB]
    async with WeightSyncClient(server.address, max_chunk_bytes=16 * MiB) as client:
        assert same_bits((await client.fetch(1)).state_dict, state)


async def test_fetch_writes_into_the_tensors_it_is_given(serve: Serve) -> None:
    server = await serve()
    await server.publish(1, 1, state_dict(seed=1))
    await server.publish(2, 2, state_dict(seed=2))
    async with WeightSyncClient(server.address) as client:
        first = await client.fetch(1)
        second = await client.fetch(2, out=first.state_dict)
    assert all(second.state_dict[k] is first.state_dict[k] for k in first.state_dict)
    assert same_bits(second.state_dict, state_dict(seed=2))


async def test_stop_is_idempotent_and_unlinks_every_segment(serve: Serve) -> None:
    server = await serve(shared_memory=True)
    names = [(await server.publish(v, v, state_dict())).shm.name for v in (1, 2)]
    await server.stop()
    await server.stop()
    assert not any((Path("/dev/shm") / name).exists() for name in names)


async def _proxy(upstream: str, fault: str) -> tuple[grpc.aio.Server, FaultInjector, str]:
    injector = FaultInjector(upstream, fault)
    proxy = grpc.aio.server(options=list(GRPC_OPTIONS))
    pb_grpc.add_WeightSyncServicer_to_server(injector, proxy)
    port = proxy.add_insecure_port("127.0.0.1:0")
    await proxy.start()
    return proxy, injector, f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("none", None),
        ("flip", "tensor 'model.embed_tokens.weight': checksum mismatch"),
        ("drop", r"tensor 'model.embed_tokens.weight': missing bytes \[1024, 1536\)"),
        ("drop-last", "missing bytes at the end of the stream: tensor 'model.norm.weight'"),
        ("duplicate", "tensor 'model.embed_tokens.weight': chunk bytes .* overlap"),
        ("rename", "unknown tensor 'model.ghost.weight'"),
        ("out-of-range", "tensor 'model.embed_tokens.weight': chunk bytes .* out of range"),
    ],
)
async def test_a_corrupted_stream_is_rejected_naming_the_tensor(
    serve: Serve, fault: str, message: str | None
) -> None:
    server = await serve()
    state = state_dict()
    await server.publish(1, 1, state)
    proxy, _, address = await _proxy(server.address, fault)
    try:
        async with WeightSyncClient(address, max_chunk_bytes=512) as client:
            if message is None:  # the plain protobuf proxy interoperates
                assert same_bits((await client.fetch(1)).state_dict, state)
            else:
                with pytest.raises(WeightSyncError, match=message):
                    await client.fetch(1)
    finally:
        await proxy.stop(0)


async def test_cancelling_a_fetch_cancels_its_stream(serve: Serve) -> None:
    server = await serve()
    await server.publish(1, 1, state_dict())
    proxy, injector, address = await _proxy(server.address, "stall")
    try:
        async with WeightSyncClient(address, max_chunk_bytes=512) as client:
            fetch = asyncio.create_task(client.fetch(1))
            await asyncio.wait_for(injector.stalled.wait(), 10)
            fetch.cancel()
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(fetch, 10)
            await asyncio.wait_for(injector.cancelled.wait(), 10)  # the server saw it end
    finally:
        await proxy.stop(0)


async def test_vllm_extension_stages_then_loads_a_version_into_the_model(serve: Serve) -> None:
    server = await serve(shared_memory=True)
    await server.publish(7, 70, state_dict(seed=3))
    worker = StandInWorker()
    staged = await asyncio.to_thread(worker.harnessrl_stage, server.address, "7")
    assert staged["ok"] and staged["transport"] == "shm"
    assert not worker.model.state()["model.norm.weight"].any()  # staged, not loaded
    assert await asyncio.to_thread(worker.harnessrl_commit, 7) == {"version": 7, "tensors": 4}
    assert same_bits(worker.model.state(), state_dict(seed=3))
    assert worker.harnessrl_version() == 7


async def test_update_weights_swaps_on_every_worker_between_pause_and_resume(
    serve: Serve,
) -> None:
    server = await serve()
    await server.publish(2, 20, state_dict(seed=4))
    engine = StandInEngine([StandInWorker(), StandInWorker()])
    results = await update_weights(engine, server.address, 2)
    assert [r["version"] for r in results] == [2, 2]
    assert engine.calls == ["pause:keep", "harnessrl_stage", "harnessrl_commit", "resume"]
    assert all(same_bits(w.model.state(), state_dict(seed=4)) for w in engine.workers)


async def test_update_weights_keeps_the_old_weights_when_a_worker_cannot_stage(
    serve: Serve,
) -> None:
    server = await serve()
    await server.publish(1, 10, state_dict(seed=5))
    engine = StandInEngine([StandInWorker()])
    await update_weights(engine, server.address, 1)
    with pytest.raises(WeightSyncError, match="version 9 not loaded: 1 of 1 workers"):
        await update_weights(engine, server.address, 9)
    assert engine.calls[-3:] == ["harnessrl_stage", "harnessrl_discard", "resume"]
    assert same_bits(engine.workers[0].model.state(), state_dict(seed=5))


async def test_a_failed_commit_leaves_the_engine_paused(serve: Serve) -> None:
    server = await serve()
    await server.publish(1, 10, state_dict())
    engine = StandInEngine([StandInWorker()])
    engine.workers[0].model.fail = True
    with pytest.raises(RuntimeError, match="shape mismatch"):
        await update_weights(engine, server.address, 1)
    assert engine.calls[-1] == "harnessrl_commit"


async def test_update_weights_http_drives_vllm_serve_endpoints(serve: Serve) -> None:
    server = await serve()
    await server.publish(3, 30, state_dict(seed=6))
    vllm = StandInVllmServer()
    await vllm.start()
    try:
        assert await served_versions_http(vllm.url) == [None]  # nothing committed yet
        results = await update_weights_http(f"{vllm.url}/", server.address, 3)
        assert results == [{"version": 3, "tensors": 4}]
        assert vllm.requests[1:] == [
            "POST /pause?mode=keep",
            "POST /collective_rpc?",
            "POST /collective_rpc?",
            "POST /resume?",
        ]
        assert same_bits(vllm.model_state(), state_dict(seed=6))
        assert await served_versions_http(vllm.url) == [3]
    finally:
        await vllm.stop()


async def test_a_version_the_trainer_no_longer_holds_is_reported_gone(serve: Serve) -> None:
    server = await serve()
    await server.publish(1, 10, state_dict())
    engine = StandInEngine([StandInWorker(), StandInWorker()])
    with pytest.raises(NotStaged) as error:
        await update_weights(engine, server.address, 9)
    assert error.value.reasons == ["gone", "gone"]
    await server.stop()  # the trainer away: worth another try
    with pytest.raises(NotStaged) as error:
        await update_weights(engine, server.address, 1)
    assert error.value.reasons == ["unreachable", "unreachable"]
    assert not engine.paused
