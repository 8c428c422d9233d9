"""A `vllm serve` that serves each policy version as a LoRA adapter (vllm_sync.lora_name).

`VllmLoraServer` is the PolicyFollower's loader when the trainer publishes adapters
(trainer.lora). For each version it pulls the adapter over WeightSync (every checksum and
the manifest, adapter description included, verified before anything changes), checks the
base model when it can read it, writes a PEFT adapter directory
`<adapter_dir>/<lora_name>-v<version>`, and loads it under that name through vLLM's runtime
LoRA API; from then on the version's PolicyLoaded names that adapter (`served_model`), and
the gateway asks vLLM for it, so each call is served by exactly the version it is stamped
with. The newest `keep_adapters` adapters stay loaded, older ones are unloaded and their
directories removed. A version that fails anywhere leaves the previous adapter serving.
During a canary rollout (rollout_follower.py) the follower chooses instead: `add` loads an
adapter beside the others and unloads nothing, `remove` unloads one, so the stable and the
candidate are never evicted; `served` lists what vLLM serves, its base model (the initial
version) under "" (vLLM's own name) until the rollout no longer needs it.

What this relies on in vLLM (docs/features/lora.md, "Dynamically serving LoRA Adapters";
vllm/entrypoints/serve/lora/api_router.py and openai/models/serving.py):
- `vllm serve <base> --enable-lora --max-lora-rank R` with
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (without it the routes below do not exist: 404);
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: 200 with a text body, or an
  error object (400 for a name already loaded or missing fields, 404 for a path that is no
  adapter, 500 when the engine refuses it); the adapter is loaded into the engine before
  the answer, so a refused one is never served;
- `POST /v1/unload_lora_adapter {"lora_name"}`: 200, or 404 for a name not loaded;
- `GET /v1/models` lists the base model and every loaded adapter by name (`id`);
- a request selects an adapter with `model: <lora_name>`.

UNTESTED against a real vLLM, which cannot run here: tests/integration/test_vllm_sync.py
drives this against the stand-in in tests/vllm_standin.py (the endpoints above, its adapter
read back from the directory with PEFT's safetensors names) with a real WeightSync server.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path
from typing import Any

from harnessrl.logs import get_logger
from harnessrl.retry import is_retryable
from harnessrl.services.inference.follower import Pull
from harnessrl.services.inference.vllm_server import VllmUnusable
from harnessrl.weights.errors import WeightSyncError

log = get_logger(__name__)


class VllmLoraServer:
    """One `vllm serve` with runtime LoRA updating, driven over HTTP. Not safe for
    concurrent `load`/`check` calls: the caller serialises them."""

    def __init__(
        self,
        url: str,
        *,
        lora_name: str,
        adapter_dir: Path,
        pull: Pull,
        initial_version: int,
        keep_adapters: int = 2,
        base_model: Path | None = None,
        timeout_s: float = 600.0,
        transport: Any = None,
    ) -> None:
        self.url = url
        self._prefix = lora_name
        self._pattern = re.compile(rf"{re.escape(lora_name)}-v(\d+)")
        self._dir = adapter_dir
        self._pull = pull
        self._initial = initial_version
        self._keep = keep_adapters
        self._base_model = base_model
        self._base_checksums: dict[str, str] = {}
        self._timeout_s = timeout_s
        self._transport = transport
        self._version = initial_version
        self._served = ""
        self._adapters: set[int] = set()
        """Versions of our adapters vLLM has loaded, as of the last check, load or unload."""
        self._base_served = True
        """Whether the base model still serves the initial version (`served`)."""

    @property
    def version(self) -> int:
        """The version vLLM serves as of the last check or load."""
        return self._version

    @property
    def served_model(self) -> str:
        """The adapter name of `version` ("" while vLLM serves its base model)."""
        return self._served

    @property
    def served(self) -> dict[int, str]:
        """Each version vLLM serves, with the model name that asks for it."""
        served = {self._initial: ""} if self._base_served else {}
        return served | {v: self.name_of(v) for v in self._adapters}

    @property
    def adapters(self) -> bool:
        return True

    @property
    def keep(self) -> int:
        return self._keep

    def name_of(self, version: int) -> str:
        """The adapter name of `version` in vLLM."""
        return f"{self._prefix}-v{version}"

    async def check(self) -> int:
        """The newest version whose adapter vLLM has loaded (`initial_version` when none:
        it serves its base). Raises a retryable error when vLLM cannot be reached or is not
        ready, VllmUnusable when /v1/models answers otherwise."""
        loaded = await self._loaded()
        newest = max(loaded, default=None)
        self._version = self._initial if newest is None else newest
        self._served = "" if newest is None else self.name_of(newest)
        return self._version

    async def load(self, address: str, version: int) -> None:
        """Pull, verify and write the adapter of `version`, load it into vLLM, unload the
        adapters beyond the newest `keep_adapters` (see WeightLoader).

        Raises VersionGone, a retryable error (trainer or vLLM unreachable), WeightSyncError
        (bytes or manifest fail verification, a full-weights version, another base model),
        or VllmRefused / VllmUnusable when vLLM refuses the adapter: the previous adapter
        keeps serving.
        """
        await self.add(address, version)
        self._version, self._served = version, self.name_of(version)
        await self._unload_older()

    async def add(self, address: str, version: int, *, adapter_only: bool = False) -> None:
        """Pull, verify and write the adapter of `version`, load it into vLLM beside the
        adapters loaded; raises as `load` does (full weights are refused whatever
        `adapter_only` says: this vLLM takes adapters only)."""
        from harnessrl.weights.adapter import write_peft_dir

        result = await self._pull(address, version)
        manifest = result.manifest
        what = f"version {version}"
        if not manifest.HasField("adapter"):
            raise WeightSyncError(
                f"{what}: full weights, but vllm_sync.lora_name is set and this vLLM takes "
                "LoRA adapters only (run vLLM with the worker extension and unset lora_name)"
            )
        await self._check_base(manifest.adapter, what)
        name = self.name_of(version)
        path = self._dir / name
        if version not in await self._loaded():  # else: a retry whose answer was lost
            await asyncio.to_thread(write_peft_dir, path, manifest.adapter, result.state_dict)
            try:
                body = {"lora_name": name, "lora_path": str(path.resolve())}
                await self._post("/v1/load_lora_adapter", body)
            except (VllmRefused, VllmUnusable):
                shutil.rmtree(path, ignore_errors=True)  # refused: vLLM never reads it
                raise
        self._adapters.add(version)
        log.info("LoRA adapter loaded into vLLM", version=version, adapter=name, path=str(path))

    async def remove(self, version: int) -> None:
        """Unload the adapter of `version` and remove its directory (idempotent); the
        initial version, served by the base model, is only no longer listed in `served`."""
        if version == self._initial and version not in self._adapters:
            self._base_served = False
            return
        name = self.name_of(version)
        if version in await self._loaded():
            await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        await asyncio.to_thread(shutil.rmtree, self._dir / name, True)
        self._adapters.discard(version)
        log.info("LoRA adapter unloaded from vLLM", adapter=name)

    async def _unload_older(self) -> None:
        """Unload our adapters beyond the newest `keep_adapters`. A failure is logged and
        left for the next load, which lists vLLM's adapters again: the new one serves."""
        try:
            loaded = sorted(await self._loaded(), reverse=True)
            for old in loaded[self._keep :]:
                name = self.name_of(old)
                await self._post("/v1/unload_lora_adapter", {"lora_name": name})
                await asyncio.to_thread(shutil.rmtree, self._dir / name, True)
                self._adapters.discard(old)
                log.info("LoRA adapter unloaded from vLLM", adapter=name)
        except Exception as err:
            if not (is_retryable(err) or isinstance(err, VllmRefused | VllmUnusable)):
                raise
            log.warning("unloading old LoRA adapters failed; next load retries", error=repr(err))

    async def _check_base(self, adapter: Any, what: str) -> None:
        from harnessrl.weights.adapter import base_checksum, check_base
        from harnessrl.weights.checksums import algorithm_of

        if not adapter.base_checksum or self._base_model is None:
            return
        algorithm = algorithm_of(adapter.base_checksum, f"{what} base_checksum")
        if algorithm not in self._base_checksums:
            self._base_checksums[algorithm] = await asyncio.to_thread(
                base_checksum, self._base_model, algorithm
            )
        check_base(adapter, self._base_checksums[algorithm], what)

    async def _loaded(self) -> list[int]:
        """Versions of our adapters vLLM lists in /v1/models."""
        answer = await self._request("GET", "/v1/models")
        models = answer.json().get("data") if answer.content else None
        if not isinstance(models, list):
            raise VllmUnusable(f"{self.url}: /v1/models answered no model list")
        versions = []
        for model in models:
            match = self._pattern.fullmatch(str(model.get("id", "")))
            if match:
                versions.append(int(match.group(1)))
        self._adapters = set(versions)
        return versions

    async def _post(self, path: str, body: dict[str, str]) -> None:
        await self._request("POST", path, json=body)

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        async with httpx.AsyncClient(
            base_url=self.url, timeout=self._timeout_s, transport=self._transport
        ) as http:
            response = await http.request(method, path, **kwargs)
        if response.status_code < 400:
            return response
        error = httpx.HTTPStatusError(
            f"{method} {path}: {response.status_code}", request=response.request, response=response
        )
        if is_retryable(error):
            raise error  # 502/503/504: starting, or behind a proxy that is
        text = " ".join(response.text.split())[:500] or "no body"
        if response.status_code == 404 and "error" not in text:  # FastAPI's: no such route
            raise VllmUnusable(
                f"{self.url}: {method} {path} does not exist ({text}); vLLM must run with "
                "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
            )
        raise VllmRefused(f"{self.url}: {method} {path} answered {response.status_code}: {text}")


class VllmRefused(Exception):
    """vLLM answered a LoRA request with an error object: nothing changed there."""
