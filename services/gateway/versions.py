"""Which policy version each engine serves, for engines that do not say so per response.

The project's engine names the version in each response's x-policy-version header; vLLM
cannot. For such an engine the gateway uses what hrl.policy says: the highest version of a
PolicyLoaded(ok=true) under the engine's name (the URL the gateway has for it; `harnessrl
vllm-sync` publishes them for vLLM). A call takes the versions as they are when it is sent,
so a response that straddles a swap is attributed to the older version: staleness is
over-estimated, never under-estimated. An engine that serves each version under its own
model name (vLLM with LoRA adapters: PolicyLoaded.served_model) is asked for that name, so
its calls are served by exactly the version they are stamped with.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from harnessrl.v1 import events_pb2 as pb


class EngineVersions:
    """The highest version each engine reported loading; idempotent, order-insensitive."""

    def __init__(self) -> None:
        self._versions: Mapping[str, int] = MappingProxyType({})
        self._models: Mapping[str, str] = MappingProxyType({})

    def loaded(self, event: pb.PolicyLoaded) -> bool:
        """Take a PolicyLoaded into account; True when it raised its engine's version."""
        engine = event.engine.rstrip("/")
        if not event.ok or event.version <= self._versions.get(engine, -1):
            return False
        # Copy on write: a snapshot a call holds never changes under it.
        self._versions = MappingProxyType({**self._versions, engine: event.version})
        self._models = MappingProxyType({**self._models, engine: event.served_model})
        return True

    def snapshot(self) -> Mapping[str, int]:
        """Engine URL -> version, as of now (read-only, never modified later)."""
        return self._versions

    def models(self) -> Mapping[str, str]:
        """Engine URL -> the model name that engine serves its version under ("": the
        gateway's engine_model), as of now: a vLLM serving versions as LoRA adapters names
        each one (PolicyLoaded.served_model). Taken together with `snapshot()` (no await in
        between), the two agree."""
        return self._models
