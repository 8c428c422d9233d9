"""Stand-ins for vLLM with the harnessrl worker extension, because vLLM cannot run here.

- `StandInWorker`: the real WeightSyncWorkerExtension mixed into a class that has the one
  attribute the extension uses, `model_runner.model`: a tiny torch module whose
  `load_weights` copies each named checkpoint tensor into its parameter, as vLLM's default
  loader does.
- `StandInEngine`: vLLM's AsyncLLM as the driver sees it: pause/resume are recorded, and
  collective_rpc runs the method on every worker in a thread, as vLLM's worker processes
  run it away from the caller's event loop.
- `StandInVllmServer`: `vllm serve` with VLLM_SERVER_DEV_MODE=1, on a loopback port with
  the project's own HttpServer: POST /pause?mode=, POST /resume, POST /collective_rpc
  ({"method", "args", "timeout"} -> {"results": [...]}; string arguments are passed through
  unconverted, as vLLM does; 500 when a worker raises), GET /health; with
  `dev_mode=False` the first three answer 404, as without VLLM_SERVER_DEV_MODE=1.
  `restart()` is vLLM restarted on the weights it started with (fresh workers, nothing
  committed); `stop()` and `start()` take it away and bring it back on the same port.
- `StandInLoraVllm`: `vllm serve` with runtime LoRA updating (/v1/models,
  /v1/load_lora_adapter, /v1/unload_lora_adapter), reading each adapter directory from disk.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import orjson
import torch

from harnessrl.http import HttpServer, Request, Response
from harnessrl.weights.vllm_worker import WeightSyncWorkerExtension
from tests.weight_helpers import state_dict

_JSON = [("content-type", "application/json")]


class TinyModel(torch.nn.Module):
    """A vLLM model as the extension sees it: parameters shaped like `state_dict()`, all
    zero at first, and load_weights."""

    def __init__(self) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict(
            {
                k.replace(".", "_"): torch.nn.Parameter(torch.zeros_like(v))
                for k, v in state_dict().items()
            }
        )
        self.fail = False

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if self.fail:
                raise RuntimeError("shape mismatch in load_weights")
            self.params[name.replace(".", "_")].data.copy_(tensor)
            loaded.add(name)
        return loaded

    def state(self) -> dict[str, torch.Tensor]:
        return {k: self.params[k.replace(".", "_")].detach() for k in state_dict()}


class StandInWorker(WeightSyncWorkerExtension):
    """A vLLM worker with the extension mixed in; see the module docstring."""

    def __init__(self) -> None:
        self.model = TinyModel()
        self.model_runner = type("ModelRunner", (), {"model": self.model})()


class StandInEngine:
    """vLLM's AsyncLLM as update_weights drives it; see the module docstring."""

    def __init__(self, workers: list[StandInWorker]) -> None:
        self.workers = workers
        self.calls: list[str] = []
        self.paused = False

    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True) -> None:
        self.calls.append(f"pause:{mode}")
        self.paused = True

    async def resume_generation(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def collective_rpc(
        self, method: str, timeout: float | None = None, args: tuple[Any, ...] = ()
    ) -> list[Any]:
        self.calls.append(method)
        return [await asyncio.to_thread(getattr(w, method), *args) for w in self.workers]


class StandInVllmServer:
    """`vllm serve` in dev mode, as the HTTP driver sees it; see the module docstring."""

    def __init__(self, workers: int = 1, *, dev_mode: bool = True) -> None:
        self._workers = workers
        self._dev_mode = dev_mode
        self.engine = StandInEngine([StandInWorker() for _ in range(workers)])
        self.requests: list[str] = []
        self.restarts = 0
        self._port = 0
        self._server: HttpServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> None:
        """Listen (again, on the same port after a stop)."""
        self._server = HttpServer(self._handle, host="127.0.0.1", port=self._port)
        await self._server.start()
        self._port = self._server.port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace_s=1.0)
            self._server = None

    def restart(self) -> None:
        """vLLM restarted: fresh workers on the initial weights, nothing staged or loaded."""
        self.engine = StandInEngine([StandInWorker() for _ in range(self._workers)])
        self.restarts += 1

    def model_state(self, worker: int = 0) -> dict[str, torch.Tensor]:
        return self.engine.workers[worker].model.state()

    async def _handle(self, request: Request) -> Response:
        self.requests.append(f"{request.method} {request.path}?{request.query}")
        engine = self.engine
        if request.method == "GET" and request.path == "/health":
            return Response(200)
        if request.method != "POST":
            return Response(405)
        if not self._dev_mode:
            return _json(404, {"detail": "Not Found"})
        if request.path == "/pause":
            mode = parse_qs(request.query).get("mode", ["abort"])[0]
            await engine.pause_generation(mode=mode)
        elif request.path == "/resume":
            await engine.resume_generation()
        elif request.path == "/collective_rpc":
            body = orjson.loads(request.body)
            if not all(isinstance(a, str) for a in body.get("args", [])):
                return _json(400, {"error": "args must be strings"})
            try:
                results = await engine.collective_rpc(body["method"], args=tuple(body["args"]))
            except Exception as err:
                return _json(500, {"error": f"{type(err).__name__}: {err}"})
            return _json(200, {"results": results})
        else:
            return _json(404, {"detail": "Not Found"})
        return _json(200, {"status": "ok"})


def _json(status: int, data: Any) -> Response:
    return Response(status, _JSON, orjson.dumps(data))


class StandInLoraVllm:
    """`vllm serve <base> --enable-lora --max-lora-rank R` with
    VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as vllm-sync's LoRA loader sees it, on a loopback
    port (vLLM cannot run here). Its routes answer as vLLM's do (openai/models/serving.py,
    serve/lora/api_router.py):

    - GET /v1/models: the base model, then every loaded adapter by name;
    - POST /v1/load_lora_adapter {"lora_name", "lora_path"}: reads the directory the way
      vLLM's loader does (adapter_config.json: r, lora_alpha, target_modules required, r at
      most max_lora_rank, no modules_to_save, no DoRA; adapter_model.safetensors: every name
      `base_model.model.<module>.lora_A|B.weight` of a target module), then 200 with a text
      body; 400 for missing fields or a name already loaded, 404 for a path with no
      adapter, 500 when the adapter is refused; each an error object;
    - POST /v1/unload_lora_adapter {"lora_name"}: 200, or 404 when not loaded;
    - with `runtime_updating=False` the two POST routes do not exist (FastAPI's 404).

    `adapters` holds what each load read from disk: (adapter_config.json, tensors).
    `restart()` is vLLM restarted: no adapter loaded.
    """

    def __init__(
        self, *, base: str = "tiny-model", max_lora_rank: int = 16, runtime_updating: bool = True
    ) -> None:
        self.base = base
        self.max_lora_rank = max_lora_rank
        self.runtime_updating = runtime_updating
        self.adapters: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
        self.paths: dict[str, str] = {}
        self.requests: list[str] = []
        self._port = 0
        self._server: HttpServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    async def start(self) -> None:
        self._server = HttpServer(self._handle, host="127.0.0.1", port=self._port)
        await self._server.start()
        self._port = self._server.port

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace_s=1.0)
            self._server = None

    def restart(self) -> None:
        self.adapters.clear()
        self.paths.clear()

    async def _handle(self, request: Request) -> Response:
        self.requests.append(f"{request.method} {request.path}")
        if request.method == "GET" and request.path == "/v1/models":
            data = [{"id": self.base, "object": "model", "root": self.base, "parent": None}]
            data += [
                {"id": name, "object": "model", "root": self.paths[name], "parent": self.base}
                for name in self.adapters
            ]
            return _json(200, {"object": "list", "data": data})
        lora = request.path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
        if request.method != "POST" or not lora or not self.runtime_updating:
            return _json(404, {"detail": "Not Found"})
        body = orjson.loads(request.body)
        name = body.get("lora_name")
        if request.path == "/v1/unload_lora_adapter":
            if name not in self.adapters:
                return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self.adapters[name], self.paths[name]
            return Response(
                200, [], f"Success: LoRA adapter '{name}' removed successfully.".encode()
            )
        path = body.get("lora_path")
        if not name or not path:
            return _error(
                400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput"
            )
        if name in self.adapters:
            return _error(
                400, f"The lora adapter '{name}' has already been loaded.", "InvalidUserInput"
            )
        directory = Path(path)
        if not (directory / "adapter_config.json").is_file():
            return _error(
                404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError"
            )
        try:
            self.adapters[name] = _read_adapter(directory, self.max_lora_rank)
        except ValueError as err:
            return _error(500, str(err), "InternalServerError")
        self.paths[name] = path
        return Response(200, [], f"Success: LoRA adapter '{name}' added successfully.".encode())


def _read_adapter(directory: Path, max_rank: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = orjson.loads((directory / "adapter_config.json").read_bytes())
    missing = {"r", "lora_alpha", "target_modules"} - set(config)
    if missing:
        raise ValueError(f"Missing required configuration fields: {missing}")
    if config.get("modules_to_save") or config.get("use_dora"):
        raise ValueError("vLLM only supports modules_to_save being None; no DoRA")
    if config["r"] > max_rank:
        raise ValueError(f"LoRA rank {config['r']} is greater than max_lora_rank {max_rank}.")
    tensors = load_file(str(directory / "adapter_model.safetensors"))
    for tensor_name in tensors:
        module, _, rest = tensor_name.removeprefix("base_model.model.").rpartition(".lora_")
        if rest not in ("A.weight", "B.weight") or module.rpartition(".")[2] not in set(
            config["target_modules"]
        ):
            raise ValueError(
                f"While loading {directory}, expected target modules in "
                f"{config['target_modules']} but received {tensor_name}"
            )
    return config, tensors


def _error(status: int, message: str, kind: str) -> Response:
    return _json(status, {"error": {"message": message, "type": kind, "code": status}})
