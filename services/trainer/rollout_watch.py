"""The trainer's side of a canary rollout (production.canary): what hrl.policy decided, and
which versions it must keep servable.

The trainer folds hrl.policy's PolicyVersion and RolloutDecision events with the same
`RolloutState` every service uses, so it agrees with the gateways, engines and the judge on
which version is stable, which is the candidate and which are retired. The team's rule for
training under a canary:

Both arms' explored sessions train (behaviour log-probs recorded; the clipped ratio
corrects). A rolled-back version and every version descending from it are retired: the
trainer rewinds its weights to the stable version with a fresh optimiser, announces later
versions with `base` = that stable version, and never trains a sample produced by a retired
version (its tokens are dropped as `rolled_back`, in PolicyVersion.tokens_dropped, so the
books stay exact). Tokens already trained into a retired version stay counted as trained
(by that version).

This module keeps the versions a rollout needs (`needed`: the stable version, the one
stable before it, which an operator's rollback of stable returns to, and the candidate)
protected in the WeightSync server, so no later publication evicts them, and archived
under the checkpoint directory (archive.py), so a restarted trainer serves them again
and can rewind to the stable version; the service decides when to rewind.
"""

from __future__ import annotations

import asyncio

from harnessrl.logs import get_logger
from harnessrl.rollout import ACTION_NAMES, Rollout, RolloutState, describe
from harnessrl.services.trainer.archive import VersionArchive
from harnessrl.v1 import events_pb2 as pb
from harnessrl.weights import WeightSyncServer

log = get_logger(__name__)


class RolloutWatch:
    """The fold of hrl.policy, and the versions it needs kept (see the module docstring)."""

    def __init__(self, archive: VersionArchive) -> None:
        self.archive = archive
        self._fold = RolloutState()
        self._kept: frozenset[int] | None = None
        """The versions protected and archived by the last `keep` (None: never kept)."""
        self._keeping = asyncio.Lock()
        self._depths: dict[int, int] = {}
        """Version -> its depth (`depth`), memoised: a version's base never changes."""

    @property
    def state(self) -> Rollout:
        return self._fold.state

    def depth(self, version: int) -> int:
        """Steps from the first weights to `version` along the versions it was trained from
        (PolicyVersion.base): after a rewind to stable, the next version is one step past
        stable, however high its number. A version not announced yet counts as its number."""
        known = self._depths.get(version)
        if known is not None:
            return known
        bases = self._fold.state.bases
        chain: list[int] = []
        current: int | None = version
        while current is not None and current not in self._depths and current in bases:
            chain.append(current)
            current = bases[current]
        depth = self._depths.get(current, current) if current is not None else 0
        for item in reversed(chain):
            depth += 1
            self._depths[item] = depth
        return self._depths.get(version, version)

    def retired(self, version: int) -> bool:
        """Whether `version` was rolled back or descends from a version that was."""
        return self._fold.state.retired(version)

    def announced(self, event: pb.PolicyVersion) -> None:
        """Fold a PolicyVersion (idempotent)."""
        self._fold.announced(event)

    def decided(self, decision: pb.RolloutDecision) -> bool:
        """Fold a RolloutDecision (idempotent); True when it applied now (not before, not
        refused). A refused one is logged with every service's reason. The fold is
        replay-safe: the trainer reads hrl.policy's history at start, then its consumer's
        records, and a decision seen twice keeps its outcome."""
        before = self._fold.state
        reason = self._fold.decided(decision)
        if reason is not None:
            log.info(
                "rollout decision refused",
                decision_id=decision.decision_id,
                action=ACTION_NAMES.get(decision.action, str(decision.action)),
                version=decision.version,
                reason=reason,
            )
            return False
        applied = self._fold.state is not before
        if applied:
            log.info(
                "rollout decision applied",
                decision_id=decision.decision_id,
                action=ACTION_NAMES[decision.action],
                version=decision.version,
                actor=decision.actor,
                **describe(self._fold.state),
            )
        return applied

    def needed(self) -> frozenset[int]:
        """The versions kept servable: stable, the one stable before it, the candidate."""
        state = self._fold.state
        versions = (*state.stables[-2:], state.stable, state.candidate)
        return frozenset(v for v in versions if v is not None)

    async def keep(self, server: WeightSyncServer) -> None:
        """Protect `needed()` in `server`, archive those it holds that are not archived
        yet, and remove archived versions no longer needed (idempotent; file work in a
        worker thread). A needed version neither held nor archived is logged: engines that
        do not have it cannot get it, and the trainer cannot rewind to it."""
        async with self._keeping:  # one at a time: the consumer's and the start's
            needed = self.needed()
            if needed == self._kept:
                return
            server.protect(needed)
            archived = set(await asyncio.to_thread(self.archive.versions))
            missing = []
            for version in sorted(needed - archived):
                published = server.published(version)
                if published is None:
                    missing.append(version)
                    continue
                await asyncio.to_thread(self.archive.save, *published)
            await asyncio.to_thread(self.archive.keep, needed)
            if missing:  # tried again next time (the trainer may be about to publish it)
                log.warning(
                    "versions the rollout needs are neither held nor archived",
                    versions=missing,
                    archive=str(self.archive.root),
                )
            else:
                self._kept = needed

    async def restore(self, server: WeightSyncServer) -> list[int]:
        """Serve the archived versions the rollout needs again (a trainer that restarted:
        they are older than what it publishes next). Returns the versions re-held. Raises
        ValueError when an archived version does not hash to what was published (same
        checksum algorithm)."""
        needed = self.needed()
        server.protect(needed)
        restored = []
        for version in sorted(needed & set(await asyncio.to_thread(self.archive.versions))):
            if version in server.versions:
                continue
            manifest, tensors = await asyncio.to_thread(self.archive.load, version)
            adapter = manifest.adapter if manifest.HasField("adapter") else None
            copy = await server.publish(version, manifest.step, tensors, adapter=adapter)
            algorithm = manifest.manifest_checksum.partition(":")[0]
            same_algorithm = copy.manifest_checksum.startswith(f"{algorithm}:")
            if same_algorithm and copy.manifest_checksum != manifest.manifest_checksum:
                raise ValueError(
                    f"{self.archive.path(version)}: version {version} hashes to "
                    f"{copy.manifest_checksum}, it was published as {manifest.manifest_checksum}"
                )
            restored.append(version)
        if restored:
            log.info("archived versions served again", versions=restored)
        return restored
