"""Which policy versions each engine serves, and under which model name.

The project's engine names the version in each response's x-policy-version header; vLLM
cannot. For such an engine the gateway uses what hrl.policy says: its PolicyLoaded(ok=true)
events under the engine's name (the URL the gateway has for it; `harnessrl vllm-sync`
publishes them for vLLM). A call takes the versions as they are when it is sent, so a
response that straddles a swap is attributed to the older version: staleness is
over-estimated, never under-estimated. An engine that serves each version under its own
model name (vLLM with LoRA adapters: PolicyLoaded.served_model) is asked for that name, so
its calls are served by exactly the version they are stamped with.

An engine may serve several versions at once (a canary's stable and candidate as LoRA
adapters): its PolicyLoaded lists them all in `serving`, each with its model name, and its
latest such event replaces what the gateway knew of it (hrl.policy has one partition, so
events arrive in the order engines sent them; a consumer's replay after a restart ends on
the latest event too). An event with no `serving` list adds nothing but its own version,
kept only when it is the engine's highest, as before versions were listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from harnessrl.v1 import events_pb2 as pb

Served = Mapping[str, Mapping[int, str]]
"""Engine URL -> {version it serves: the model name that asks for it ("": engine_model)}."""


class EngineVersions:
    """What each engine reported serving; idempotent. Snapshots are copies on write: one
    a call holds never changes under it."""

    def __init__(self) -> None:
        self._versions: Mapping[str, int] = MappingProxyType({})
        self._models: Mapping[str, str] = MappingProxyType({})
        self._serving: Served = MappingProxyType({})

    def loaded(self, event: pb.PolicyLoaded) -> bool:
        """Take a PolicyLoaded into account; True when it changed what its engine serves."""
        engine = event.engine.rstrip("/")
        if not event.ok:
            return False
        if event.serving:
            served = {int(s.version): s.model for s in event.serving}
            if dict(self._serving.get(engine, {})) == served:
                return False
        elif event.version > self._versions.get(engine, -1):
            served = {int(event.version): event.served_model}
        else:
            return False
        highest = max(served)
        self._serving = MappingProxyType({**self._serving, engine: MappingProxyType(served)})
        self._versions = MappingProxyType({**self._versions, engine: highest})
        self._models = MappingProxyType({**self._models, engine: served[highest]})
        return True

    def snapshot(self) -> Mapping[str, int]:
        """Engine URL -> the highest version it serves, as of now (read-only, never
        modified later)."""
        return self._versions

    def models(self) -> Mapping[str, str]:
        """Engine URL -> the model name that engine serves its highest version under ("":
        the gateway's engine_model), as of now: a vLLM serving versions as LoRA adapters
        names each one (PolicyLoaded.served_model). Taken together with `snapshot()` (no
        await in between), the two agree."""
        return self._models

    def serving(self) -> Served:
        """Engine URL -> every version it serves with its model name, as of now."""
        return self._serving

    def serves(self, version: int) -> bool:
        """Whether some engine serves `version` now."""
        return any(version in served for served in self._serving.values())
