"""Continuous batching on a transformers causal LM.

One asyncio task drives the loop; the model runs in a worker thread one step at a time, so
the event loop keeps serving HTTP. Each step: drop finished rows, prefill the requests that
arrived since the last step and merge them into the running batch, then decode one token
for every row. A request that arrives while a batch decodes therefore joins at the next step.

A step that raises (a device error, an out-of-memory, a bug a request's input reaches) fails
the requests of that step's batch, each with the error (`EngineRequest.error`), throws the batch's
KV cache away, and the loop goes on with the requests still waiting: one bad step never
takes the engine down with it, nor leaves the requests in it waiting forever.

Weights are swapped only between steps and only once no request is running: `swap()` stops
admission, lets in-flight requests finish, loads the new state dict, then admits again. So no
request ever sees a half-updated model, and each request is served by exactly one policy
version, the one it reports. A version that is a LoRA adapter is applied on the untouched
base weights (adapter.py); a later full version replaces the base and drops the adapter.

During a canary rollout the engine serves several LoRA versions at once (`add`, `remove`):
a request may ask for one (`submit(version=...)`), else it gets the newest served; each
row of a batch gets its own version's adapter (lora_hooks.LoraRows), so a batch mixes
versions. Adding a version waits only for the step under way; removing one refuses new
requests for it at once and waits for those already queued or running to finish, so no
request for another version is disturbed and none changes version mid-way.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from harnessrl.logs import get_logger
from harnessrl.services.inference.kv import RunningBatch, cache_argument, positions_from_mask
from harnessrl.services.inference.lora_hooks import LoraOverlay
from harnessrl.services.inference.sampling import SamplingParams, generator_for, sample
from harnessrl.services.inference.served_versions import ServedVersions, copy_full_weights
from harnessrl.v1 import weights_pb2 as pb

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Token:
    """One sampled token, as streamed to the API layer."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-prob) of the most likely tokens
    finish_reason: str | None  # set on the request's last token: "stop" | "length"


@dataclass(eq=False)
class EngineRequest:
    """A request inside the engine. `tokens` receives each Token, then None at the end."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    top_logprobs: int = 0
    requested: int | None = None
    """The policy version the request asked for (None: the newest the engine serves)."""
    version: int = -1  # policy version that serves it, set at admission
    admitted: asyncio.Event = field(default_factory=asyncio.Event)
    tokens: asyncio.Queue[Token | None] = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False
    error: str | None = None
    """Why the engine failed this request (its step raised); its tokens then end early."""
    ended: bool = False
    """`tokens` has had its None."""
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.generator = generator_for(self.params.seed)

    def end(self) -> None:
        """Put the None that ends `tokens` (once)."""
        if not self.ended:
            self.ended = True
            self.tokens.put_nowait(None)


class VersionNotServed(LookupError):
    """A request asked for a policy version the engine does not serve (or is removing)."""

    def __init__(self, version: int) -> None:
        super().__init__(f"version {version} is not served here")
        self.version = version


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "harnessrl_engine_requests", "Requests admitted.", registry=registry
        )
        self.tokens = Counter(
            "harnessrl_engine_generated_tokens", "Tokens generated.", registry=registry
        )
        self.prompt_tokens = Counter(
            "harnessrl_engine_prompt_tokens", "Prompt tokens prefilled.", registry=registry
        )
        self.batch = Histogram(
            "harnessrl_engine_batch_size",
            "Rows per decode step.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=registry,
        )
        self.step = Histogram(
            "harnessrl_engine_step_seconds", "Time of one engine step.", registry=registry
        )
        self.waiting = Gauge(
            "harnessrl_engine_waiting", "Requests waiting for admission.", registry=registry
        )
        self.running = Gauge("harnessrl_engine_running", "Requests decoding.", registry=registry)
        self.version = Gauge(
            "harnessrl_engine_policy_version", "Policy version being served.", registry=registry
        )
        self.step_failures = Counter(
            "harnessrl_engine_step_failures",
            "Engine steps that raised (their requests failed).",
            registry=registry,
        )


class Engine:
    """Serves generation requests from one model; see the module docstring."""

    def __init__(
        self,
        model: Any,
        *,
        eos_ids: frozenset[int],
        pad_id: int,
        max_model_len: int,
        max_batch: int,
        version: int,
        registry: CollectorRegistry,
        decode: Callable[[list[int]], str],
    ) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.eos_ids = eos_ids
        self.pad_id = pad_id
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.version = version
        self._decode = decode
        self._metrics = EngineMetrics(registry)
        self._metrics.version.set(version)
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._batch = RunningBatch()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._swapping = 0
        self._busy = False  # a step is running in the worker thread
        self._cache_arg = cache_argument(model)
        self._served = ServedVersions(model, version)
        self._stepped = asyncio.Event()
        """Set after every step (removals wait on it for their requests to finish)."""
        self._ids = itertools.count()
        self._stopped = False
        self.last_step_at = time.monotonic()

    # -- requests ----------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        top_logprobs: int = 0,
        version: int | None = None,
    ) -> EngineRequest:
        """Queue a request; read its tokens from `request.tokens` until None.

        `version`: the policy version to serve it (None: the newest served at admission).
        The caller has checked that prompt + max_tokens fits max_model_len. Raises
        ValueError for an empty prompt (a prefill needs at least one token),
        VersionNotServed for a version not served (or being removed).
        """
        if not prompt_ids:
            raise ValueError("prompt_ids: must not be empty")
        if version is not None and version not in self.versions:
            raise VersionNotServed(version)
        request = EngineRequest(
            f"req-{next(self._ids)}", list(prompt_ids), params, top_logprobs, version
        )
        self._waiting.append(request)
        self._metrics.waiting.set(len(self._waiting))
        self._wake.set()
        return request

    def abort(self, request: EngineRequest) -> None:
        """Stop generating for a request whose client went away (idempotent)."""
        if request.aborted or request.finish_reason is not None:
            return
        request.aborted = True
        if request in self._waiting:
            self._waiting.remove(request)
        request.end()
        self._stepped.set()  # a removal waiting for this request looks again

    @property
    def load(self) -> tuple[int, int]:
        """(waiting, running) request counts."""
        return len(self._waiting), len(self._running)

    # -- weights -----------------------------------------------------------------------------

    @property
    def versions(self) -> tuple[int, ...]:
        """The versions a request may ask for now, ascending."""
        return self._served.versions

    async def swap(
        self,
        version: int,
        state_dict: dict[str, torch.Tensor],
        adapter: pb.LoraAdapter | None = None,
    ) -> None:
        """Serve `state_dict` as `version`, alone, from the next admitted request on.

        `adapter` set: `state_dict` holds a LoRA adapter's pairs (published names), applied
        on the base weights in place of every previous adapter. Waits for running requests
        to finish (new ones wait meanwhile). Raises ValueError (missing, unknown or
        mis-shaped tensors) before anything changes: the old weights then stay.
        """
        self._swapping += 1
        try:
            while self._running or self._busy:
                self._idle.clear()
                self._wake.set()
                await self._idle.wait()
            overlay = await asyncio.to_thread(self._load, state_dict, adapter)
            self._served.replace(version, overlay)
            self._set_version(version)
        finally:
            self._swapping -= 1
            self._wake.set()

    async def add(
        self, version: int, state_dict: dict[str, torch.Tensor], adapter: pb.LoraAdapter
    ) -> None:
        """Serve the LoRA adapter `state_dict` as `version` beside the versions served
        (replacing `version`'s adapter if it is served). Requests for other versions go on;
        it joins between two steps. Raises ValueError (LoraOverlay.build) before anything
        changes."""
        overlay = await asyncio.to_thread(LoraOverlay.build, self.model, adapter, state_dict)
        if self._served.held(version):
            await self.remove(version, keep_last=False)
        # Hooked in the worker thread before the next step's first forward: a request for
        # `version` is admitted at that step at the earliest.
        self._served.add(version, overlay)
        self._set_version(max(self.versions))

    async def remove(self, version: int, *, keep_last: bool = True) -> None:
        """Stop serving `version` (idempotent): new requests for it are refused at once
        (VersionNotServed), those queued or running for it finish first. Raises ValueError
        when it is the only version served and `keep_last`."""
        if not self._served.held(version):
            return
        others = [v for v in self.versions if v != version]
        if keep_last and not others:
            raise ValueError(f"version {version} is the only version served; add another first")
        self._served.retire(version)
        if others:
            self._set_version(max(others))
        while self._uses(version):
            self._stepped.clear()
            self._wake.set()
            await self._stepped.wait()
        self._served.forget(version)

    def _uses(self, version: int) -> bool:
        """Whether a request queued or unfinished asks for or is served `version`."""
        waiting = any(
            r.requested == version or (r.requested is None and self.version == version)
            for r in self._waiting
        )
        running = any(
            r.version == version and r.finish_reason is None and not r.aborted
            for r in self._running
        )
        return waiting or running

    def _set_version(self, version: int) -> None:
        self.version = version
        self._metrics.version.set(version)

    def _load(
        self, state_dict: dict[str, torch.Tensor], adapter: pb.LoraAdapter | None
    ) -> LoraOverlay | None:
        """The adapter `state_dict` is, checked; or full weights, copied into the model."""
        if adapter is not None:
            return LoraOverlay.build(self.model, adapter, state_dict)  # checks everything
        copy_full_weights(self.model, state_dict)
        return None

    # -- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until stop(); cancelled with the service. The adapters' hooks leave the
        model with the loop (the model computes its base weights again)."""
        try:
            await self._loop()
        finally:
            self._served.clear()

    async def _loop(self) -> None:
        while not self._stopped:
            admitted = self._admit()
            if not self._running and not admitted:
                self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.perf_counter()
            self._busy = True
            try:
                outputs = await asyncio.to_thread(self._step, admitted)
            except Exception as err:
                self._fail_batch(admitted, err)
                continue
            finally:
                self._busy = False
                self._stepped.set()
            self._metrics.step.observe(time.perf_counter() - started)
            self.last_step_at = time.monotonic()
            self._dispatch(outputs)

    def _fail_batch(self, admitted: list[EngineRequest], err: Exception) -> None:
        """A step raised: fail every request it held, start again from an empty batch."""
        failed = list(dict.fromkeys([*self._running, *admitted]))  # in order, each once
        log.exception(
            "engine step failed; failing its requests",
            requests=len(failed),
            error=f"{type(err).__name__}: {err}",
        )
        self._metrics.step_failures.inc()
        self._running = []
        self._batch = RunningBatch()
        for request in failed:
            if not request.ended:  # a token sampled in the failed step was never sent
                request.error = f"the engine failed while generating ({type(err).__name__})"
                request.end()
        self._metrics.running.set(0)
        self.last_step_at = time.monotonic()

    async def stop(self) -> None:
        """End the loop; requests still waiting or running end without a finish reason."""
        self._stopped = True
        self._wake.set()
        self._stepped.set()
        for request in [*self._waiting, *self._running]:
            self.abort(request)

    def _admit(self) -> list[EngineRequest]:
        if self._swapping:
            return []
        room = self.max_batch - len(self._running)
        admitted = []
        while self._waiting and room > 0:
            request = self._waiting.popleft()
            request.version = self.version if request.requested is None else request.requested
            request.admitted.set()
            admitted.append(request)
            room -= 1
        self._metrics.waiting.set(len(self._waiting))
        self._metrics.requests.inc(len(admitted))
        return admitted

    def _dispatch(self, outputs: list[tuple[EngineRequest, Token]]) -> None:
        for request, token in outputs:
            request.tokens.put_nowait(token)
            if token.finish_reason is not None:
                request.end()
        self._metrics.tokens.inc(len(outputs))
        self._metrics.running.set(len(self._running))

    # -- one step (worker thread) ------------------------------------------------------------

    def _step(self, admitted: list[EngineRequest]) -> list[tuple[EngineRequest, Token]]:
        outputs: list[tuple[EngineRequest, Token]] = []
        with torch.inference_mode():
            self._drop_finished()
            if admitted:
                outputs += self._prefill(admitted)
                self._drop_finished()
            if self._running:
                outputs += self._decode_step()
        self._metrics.batch.observe(len(self._running))
        return outputs

    def _drop_finished(self) -> None:
        # Worker thread: touches only the batch, never the requests' asyncio queues.
        live = [i for i, r in enumerate(self._running) if r.finish_reason is None and not r.aborted]
        if len(live) != len(self._running):
            self._running = [self._running[i] for i in live]
            self._batch.keep(live)

    def _prefill(self, requests: list[EngineRequest]) -> list[tuple[EngineRequest, Token]]:
        from transformers import DynamicCache

        width = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, r in enumerate(requests):
            ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self._route(requests)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions_from_mask(mask),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: DynamicCache(config=self.model.config)},
        )
        self._metrics.prompt_tokens.inc(int(mask.sum()))
        self._batch.merge(out[self._cache_arg], mask)
        self._running.extend(requests)
        return self._sample(requests, out.logits[:, -1, :])

    def _decode_step(self) -> list[tuple[EngineRequest, Token]]:
        last = torch.tensor([[r.generated[-1]] for r in self._running], device=self.device)
        positions = self._batch.next_positions()
        mask = self._batch.extend_mask()
        self._route(self._running)
        out = self.model(
            input_ids=last,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self._cache_arg: self._batch.cache},
        )
        self._batch.cache = out[self._cache_arg]
        return self._sample(self._running, out.logits[:, -1, :])

    def _route(self, rows: Iterable[EngineRequest]) -> None:
        """Each row of the next forward gets its request's version's adapter."""
        self._served.route([r.version for r in rows], self.device)

    def _sample(
        self, requests: list[EngineRequest], logits: torch.Tensor
    ) -> list[tuple[EngineRequest, Token]]:
        top_k = max(r.top_logprobs for r in requests)
        tokens, logprobs, tops = sample(
            logits.cpu(), [r.params for r in requests], [r.generator for r in requests], top_k
        )
        outputs = []
        for request, token_id, logprob, top in zip(requests, tokens, logprobs, tops, strict=True):
            request.generated.append(token_id)
            request.finish_reason = self._finish_reason(request, token_id)
            outputs.append(
                (
                    request,
                    Token(token_id, logprob, top[: request.top_logprobs], request.finish_reason),
                )
            )
        return outputs

    def _finish_reason(self, request: EngineRequest, token_id: int) -> str | None:
        if token_id in self.eos_ids:
            return "stop"
        if request.params.stop and _ends_with_stop(
            self._decode(request.generated), request.params.stop
        ):
            return "stop"
        generated = len(request.generated)
        if generated >= request.params.max_tokens:
            return "length"
        if len(request.prompt_ids) + generated >= self.max_model_len:
            return "length"
        return None


def _ends_with_stop(text: str, stops: tuple[str, ...]) -> bool:
    # Checked after every token, so the first occurrence of any stop string ends generation.
    return any(stop in text for stop in stops)
