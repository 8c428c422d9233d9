"""vLLM integration: workers pull policy weights over WeightSync, the driver swaps them in.

Start vLLM with `--worker-extension-cls harnessrl.weights.vllm_worker.WeightSyncWorkerExtension`
(or `worker_extension_cls=` in the engine arguments). vLLM mixes the class into its worker
class, so its methods run in every worker process (one per tensor/pipeline-parallel rank)
when the driver calls `collective_rpc(method, args=...)`:

- `harnessrl_stage(address, version)`: fetch the version with WeightSyncClient (shared
  memory when the trainer is on this host, else gRPC), verify every checksum, keep the
  tensors in host memory. Nothing is loaded. Returns {"ok": bool, "error": str | None,
  "reason": "gone" | "unreachable" | "refused" (when not ok), ...}.
- `harnessrl_commit(version)`: load the staged tensors through the model's
  `load_weights(weights=iterable of (name, tensor))`, which maps checkpoint names (q_proj,
  k_proj, ...) onto vLLM's fused and sharded parameters, then drop them. Every worker pulls
  the whole state dict (host memory: one copy per worker while staged) and load_weights
  keeps its own shard; with the trainer on the same host the pull is a shared-memory copy.
- `harnessrl_discard(version)`, `harnessrl_version()`.

Two phases, so a tensor-parallel group is never left half updated: `update_weights` (an
AsyncLLM-like engine) and `update_weights_http` (a `vllm serve` with VLLM_SERVER_DEV_MODE=1)
pause generation, stage on every worker, commit only if every worker staged the version
(otherwise discard, resume, and raise NotStaged, a WeightSyncError that carries each failed
worker's reason: the old weights keep serving), and resume. If a commit itself fails, the
model may be partly updated: the engine is left paused and the error raised, so it never
serves a mix of two versions.

What this relies on in vLLM (its documentation):
- worker extensions, `collective_rpc` and `self.model_runner.model.load_weights(weights=...)`:
  the RLHF example examples/offline_inference/rlhf_utils.py
  (docs.vllm.ai/en/v0.10.2/examples/offline_inference/rlhf_utils.html);
- pause/resume: docs.vllm.ai/en/latest/training/async_rl/ (`pause_generation(mode="keep",
  clear_cache=True)`, `resume_generation()`; HTTP `POST /pause?mode=keep`, `POST /resume`);
- HTTP `POST /collective_rpc` (dev mode): body {"method", "args": [str], "kwargs":
  {str: str}, "timeout"}, answer {"results": [...]}; arguments arrive as strings
  (vllm/entrypoints/serve/rpc/api_router.py).

UNTESTED HERE: vLLM cannot be installed or run on the project's machines, so nothing in this
module has run inside vLLM: not that vLLM mixes the class in, not that `model_runner.model`
is the attribute path on the installed version, not the behaviour of collective_rpc,
pause/resume or the HTTP endpoints. tests/integration/test_weightsync.py runs the staging,
commit and discard logic and both drivers against hand-written stand-ins for a vLLM worker,
engine and HTTP server (tests/vllm_standin.py), with a real WeightSync server. vllm is never
imported here. `harnessrl vllm-sync` (services/inference/vllm_sync.py) is what calls
`update_weights_http` and `served_versions_http` in a deployment.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from harnessrl.logs import get_logger
from harnessrl.retry import is_retryable
from harnessrl.weights.allocator import tune_malloc
from harnessrl.weights.client import FetchResult, WeightSyncClient
from harnessrl.weights.errors import WeightSyncError

log = get_logger(__name__)
T = TypeVar("T")


def _run(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous worker code, loop or no loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    # Called on a thread that runs an event loop: block it on a fresh loop elsewhere.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


class NotStaged(WeightSyncError):
    """Some worker could not stage a version; the engine resumed on its previous weights.

    `reasons` holds each failed worker's reason: "gone" (the trainer no longer holds the
    version), "unreachable" (the trainer could not be reached: worth another try) or
    "refused" (anything else, e.g. bytes that failed verification).
    """

    def __init__(self, message: str, reasons: list[str]) -> None:
        super().__init__(message)
        self.reasons = reasons


def _stage_failure(err: Exception) -> str:
    """Why a pull failed, as NotStaged.reasons names it."""
    code = getattr(err, "code", None)
    if callable(code) and getattr(code(), "name", "") == "NOT_FOUND":  # grpc, not imported
        return "gone"
    return "unreachable" if is_retryable(err) else "refused"


def _flag(value: bool | str) -> bool:
    """Booleans arrive as strings over vLLM's HTTP collective_rpc."""
    return value if isinstance(value, bool) else value.strip().lower() in ("1", "true", "yes")


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class; methods are called via collective_rpc.

    Relies on the worker having `model_runner.model.load_weights` (vLLM's worker does).
    Arguments may arrive as strings (HTTP collective_rpc) and are converted.
    """

    model_runner: Any  # provided by vLLM's worker class
    _harnessrl_staged: FetchResult | None = None
    _harnessrl_loaded: int | None = None

    def harnessrl_stage(
        self,
        address: str,
        version: int | str,
        use_shm: bool | str = True,
        tune_allocator: bool | str = False,
    ) -> dict[str, Any]:
        """Fetch and verify `version` from the WeightSync server at `address`; load nothing.

        Returns {"ok": True, "version", "transport", "bytes", "seconds"}, or {"ok": False,
        "version", "error", "reason"} when the pull failed (corrupt bytes, version gone,
        server down; `reason` as NotStaged.reasons names it): the model is untouched either
        way. Replaces an earlier staged version.
        `tune_allocator` applies harnessrl.weights.tune_malloc() in this worker first.
        """
        version = int(version)
        self._harnessrl_staged = None
        if _flag(tune_allocator):
            tune_malloc()

        async def pull() -> FetchResult:
            async with WeightSyncClient(address) as client:
                return await client.fetch(version, use_shm=_flag(use_shm))

        try:
            result = _run(pull)
        except Exception as err:  # reported to the driver, which decides for all workers
            log.warning("weights version not staged", version=version, error=str(err))
            return {
                "ok": False,
                "version": version,
                "error": f"{type(err).__name__}: {err}",
                "reason": _stage_failure(err),
            }
        self._harnessrl_staged = result
        return {
            "ok": True,
            "version": version,
            "transport": result.transport,
            "bytes": result.manifest.total_bytes,
            "seconds": round(result.seconds, 3),
        }

    def harnessrl_commit(self, version: int | str) -> dict[str, Any]:
        """Load the staged `version` into the model; WeightSyncError if it is not staged.

        Errors from the model's load_weights propagate (the model may be partly updated).
        """
        version = int(version)
        staged = self._harnessrl_staged
        if staged is None or staged.version != version:
            have = None if staged is None else staged.version
            raise WeightSyncError(
                f"version {version} is not staged on this worker (staged: {have})"
            )
        self._harnessrl_staged = None
        loaded = self.model_runner.model.load_weights(weights=iter(staged.state_dict.items()))
        self._harnessrl_loaded = version
        log.info("weights version loaded", version=version, tensors=len(staged.state_dict))
        return {"version": version, "tensors": len(loaded) if loaded is not None else None}

    def harnessrl_discard(self, version: int | str) -> dict[str, Any]:
        """Drop the staged tensors of `version`, if staged (idempotent)."""
        staged = self._harnessrl_staged
        dropped = staged is not None and staged.version == int(version)
        if dropped:
            self._harnessrl_staged = None
        return {"version": int(version), "dropped": dropped}

    def harnessrl_version(self) -> int | None:
        """The version last committed on this worker (None before the first)."""
        return self._harnessrl_loaded


async def _two_phase(
    rpc: Callable[..., Awaitable[list[Any]]],
    address: str,
    version: int,
    pause: Callable[[], Awaitable[None]],
    resume: Callable[[], Awaitable[None]],
) -> list[dict[str, Any]]:
    await pause()
    committing = False
    try:
        staged = await rpc("harnessrl_stage", address, version)
        failed = [r for r in staged if not (isinstance(r, dict) and r.get("ok"))]
        if failed:
            await rpc("harnessrl_discard", version)
            errors = "; ".join(str(r.get("error") if isinstance(r, dict) else r) for r in failed)
            raise NotStaged(
                f"version {version} not loaded: {len(failed)} of {len(staged)} workers could "
                f"not stage it ({errors}); the previous weights keep serving",
                [
                    str(r.get("reason", "refused")) if isinstance(r, dict) else "refused"
                    for r in failed
                ],
            )
        committing = True
        committed: list[dict[str, Any]] = await rpc("harnessrl_commit", version)
        committing = False
        log.info("weights version swapped in", version=version, workers=len(committed))
        return committed
    finally:
        if not committing:
            await resume()
        else:
            log.error("weights commit failed; engine left paused", version=version)


async def update_weights(
    engine: Any,
    address: str,
    version: int,
    *,
    pause_mode: str = "keep",
    clear_cache: bool = True,
    timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """Pause, pull `version` on every worker, swap it in, resume: on an AsyncLLM-like engine.

    `engine` needs async `pause_generation(mode=, clear_cache=)`, `resume_generation()` and
    `collective_rpc(method, timeout=, args=)`. Returns each worker's commit result. Raises
    NotStaged (engine resumed on its old weights) when any worker could not stage the
    version; an error during the commit leaves the engine paused and propagates.
    """

    async def rpc(method: str, *args: Any) -> list[Any]:
        results = engine.collective_rpc(method, timeout=timeout_s, args=args)
        return list(await results if inspect.isawaitable(results) else results)

    async def pause() -> None:
        await engine.pause_generation(mode=pause_mode, clear_cache=clear_cache)

    async def resume() -> None:
        await engine.resume_generation()

    return await _two_phase(rpc, address, version, pause, resume)


class _VllmHttp:
    """The dev-mode endpoints of one `vllm serve`, over an httpx client."""

    def __init__(self, http: Any, timeout_s: float) -> None:
        self._http = http
        self._timeout_s = timeout_s

    async def post(self, path: str, **kwargs: Any) -> Any:
        response = await self._http.post(path, **kwargs)
        response.raise_for_status()
        return response.json() if response.content else None

    async def rpc(self, method: str, *args: Any) -> list[Any]:
        body = {"method": method, "args": [str(a) for a in args], "timeout": self._timeout_s}
        answer = await self.post("/collective_rpc", json=body)
        return list((answer or {}).get("results") or [])


@asynccontextmanager
async def _vllm_http(
    base_url: str, timeout_s: float, headers: Mapping[str, str] | None, transport: Any
) -> AsyncIterator[_VllmHttp]:
    import httpx

    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        headers=dict(headers or {}),
        timeout=timeout_s + 30,
        transport=transport,
    ) as http:
        yield _VllmHttp(http, timeout_s)


async def update_weights_http(
    base_url: str,
    address: str,
    version: int,
    *,
    pause_mode: str = "keep",
    timeout_s: float = 600.0,
    headers: Mapping[str, str] | None = None,
    transport: Any = None,
) -> list[dict[str, Any]]:
    """The same sequence against a `vllm serve` HTTP server (VLLM_SERVER_DEV_MODE=1).

    `base_url` is the server root (no /v1). `transport` is an optional httpx transport.
    Raises httpx.HTTPStatusError when an endpoint answers an error, httpx.TransportError
    when the server cannot be reached, and as update_weights.
    """
    async with _vllm_http(base_url, timeout_s, headers, transport) as vllm:

        async def pause() -> None:
            await vllm.post("/pause", params={"mode": pause_mode})

        async def resume() -> None:
            await vllm.post("/resume")

        return await _two_phase(vllm.rpc, address, version, pause, resume)


async def served_versions_http(
    base_url: str,
    *,
    timeout_s: float = 30.0,
    headers: Mapping[str, str] | None = None,
    transport: Any = None,
) -> list[int | None]:
    """Each worker's `harnessrl_version()` on a `vllm serve` (VLLM_SERVER_DEV_MODE=1): the
    version it last committed, None before its first commit (it serves the weights vLLM
    started with). Raises as update_weights_http."""
    async with _vllm_http(base_url, timeout_s, headers, transport) as vllm:
        results = await vllm.rpc("harnessrl_version")
    return [None if r is None else int(r) for r in results]
