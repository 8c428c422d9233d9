"""Groups in, batches out: what the next optimiser step trains on.

GroupSamples arrive one record per group. A sample already trained on (a re-delivery after
a restart) is skipped; a stale sample is dropped (counted), when it arrives and again when its
batch is taken, by one rule (`Staleness`): its oldest call is more than `max_staleness`
versions behind the current policy, or older than the trainer ledger's horizon. A production
session's samples (estimator `session_baseline`) wait for feedback that comes hours later,
so theirs is a bound of their own, `max_session_staleness`, and what passes it is dropped as
`too_stale`; within it the clipped, importance-weighted loss (loss.py: the ratio of the
policy's log-prob to the recorded behaviour log-prob, clipped and dual-clipped) corrects for
the versions in between. Under a canary rollout (`retired` given), a sample produced by a
version that was rolled back, or descends from one, is never trained: it is dropped as
`rolled_back`, at arrival and when taken, whatever its staleness. A batch is
due once `batch_groups` groups (or `batch_tokens` tokens) are pending; it is taken whole, in
arrival order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Set
from dataclasses import dataclass, field

from harnessrl.trust.packing import SampleArrays
from harnessrl.trust.session_samples import ESTIMATOR as SESSION_ESTIMATOR
from harnessrl.v1 import events_pb2 as pb


@dataclass(frozen=True, slots=True)
class Staleness:
    """Which samples are too old to train: the one rule, at arrival and when taken."""

    max_versions: int
    """The most versions a sample's oldest call may be behind the policy it trains."""
    max_session_versions: int = 0
    """The same for a production session's sample."""

    def stale(
        self, version: int, oldest: int, horizon: int = 0, *, session: bool = False, age: int = -1
    ) -> bool:
        """Whether a sample whose oldest call was made by policy `oldest` is stale at policy
        `version` (`age`, when >= 0: the steps between them along the weights' lineage, which
        differs from `version - oldest` after a rewind); one older than `horizon` (the
        trainer ledger's, below which it no longer remembers what was trained) is stale
        however large `max_versions` is."""
        bound = self.max_session_versions if session else self.max_versions
        return (version - oldest if age < 0 else age) > bound or oldest < horizon

    @property
    def remembered(self) -> int:
        """Versions back the trainer must remember what it trained (the larger bound)."""
        return max(self.max_versions, self.max_session_versions)


def stale_reason(group: pb.GroupSamples) -> str:
    """The token books' reason for a stale sample of `group`."""
    return "too_stale" if group.estimator == SESSION_ESTIMATOR else "stale"


@dataclass(slots=True)
class Batch:
    samples: list[SampleArrays] = field(default_factory=list)
    groups: list[pb.GroupSamples] = field(default_factory=list)
    """The groups as received (their span ids link the step's span to them)."""
    tokens: int = 0
    stale: list[str] = field(default_factory=list)
    """Ids of the samples of `groups` dropped when the batch was taken (stale, rolled back)."""
    session: bool = False
    """A production session's group (one entry per group while pending)."""


class Batcher:
    def __init__(
        self,
        *,
        batch_groups: int,
        batch_tokens: int | None,
        max_staleness: int,
        max_session_staleness: int = 0,
        retired: Callable[[int], bool] | None = None,
        depth: Callable[[int], int] | None = None,
    ) -> None:
        """`retired(version)`: whether a version was rolled back or descends from one (a
        canary rollout's RolloutState; None: no version ever is). `depth(version)`: its
        steps from the first weights along the versions it was trained from, so staleness
        counts the steps a sample is behind after a rewind too (None: the version number)."""
        self._batch_groups = batch_groups
        self._retired = retired
        self._depth = depth
        self._batch_tokens = batch_tokens
        self.staleness = Staleness(max_staleness, max_session_staleness)
        self._horizon = 0
        self._pending: list[Batch] = []
        """One entry per pending group, in arrival order."""
        self.dropped: Counter[str] = Counter()
        """Samples not trained on, by reason ("stale", "too_stale", "rolled_back", "trained")."""
        self.dropped_tokens: Counter[str] = Counter()
        """Their loss-mask tokens (the trainer's part of the token books): a sample trained
        already was counted when it was trained, so only stale ones are."""

    def add(
        self, group: pb.GroupSamples, *, version: int, trained: Set[str], horizon: int = 0
    ) -> list[str]:
        """Take a group's samples (idempotent per sample id) at current policy `version`,
        skipping those in `trained` or pending; a sample with a policy_version_min below
        `horizon` is stale however large max_staleness is. Returns the ids taken."""
        session = group.estimator == SESSION_ESTIMATOR
        reason = stale_reason(group)
        entry = Batch(groups=[group], session=session)
        pending = self.pending_ids()
        for sample in group.samples:
            if sample.sample_id in trained or sample.sample_id in pending:
                self.dropped["trained"] += 1
                continue
            self._horizon = max(self._horizon, horizon)
            if self.rolled_back(sample.policy_version_min, sample.policy_version_max):
                self.dropped["rolled_back"] += 1
                self.dropped_tokens["rolled_back"] += sum(1 for m in sample.loss_mask if m)
                continue
            if self.staleness.stale(
                version,
                sample.policy_version_min,
                self._horizon,
                session=session,
                age=self._age(version, sample.policy_version_min),
            ):
                self.dropped[reason] += 1
                self.dropped_tokens[reason] += sum(1 for m in sample.loss_mask if m)
                continue
            arrays = SampleArrays.from_proto(sample)
            entry.samples.append(arrays)
            entry.tokens += len(arrays.token_ids)
            pending.add(arrays.sample_id)  # a group that repeats an id trains it once
        if entry.samples:
            self._pending.append(entry)
        return [s.sample_id for s in entry.samples]

    def drop_group(self, group_id: str, reason: str) -> list[str]:
        """Take the pending samples of `group_id` out (a deleted session): they are never
        trained, their loss-mask tokens counted under `reason`. Returns their ids."""
        dropped: list[str] = []
        kept: list[Batch] = []
        for entry in self._pending:
            if any(g.group_id == group_id for g in entry.groups):
                dropped += [s.sample_id for s in entry.samples]
                self.dropped[reason] += len(entry.samples)
                self.dropped_tokens[reason] += sum(int(s.loss_mask.sum()) for s in entry.samples)
            else:
                kept.append(entry)
        self._pending = kept
        return dropped

    def rolled_back(self, oldest: int, newest: int) -> bool:
        """Whether a version in [oldest, newest] (a sample's calls) is retired."""
        retired = self._retired
        if retired is None:
            return False
        return any(retired(v) for v in range(oldest, max(oldest, newest) + 1))

    def pending_ids(self) -> set[str]:
        return {s.sample_id for entry in self._pending for s in entry.samples}

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def due(self) -> bool:
        if len(self._pending) >= self._batch_groups:
            return True
        tokens = sum(entry.tokens for entry in self._pending)
        return self._batch_tokens is not None and tokens >= self._batch_tokens and tokens > 0

    def _age(self, version: int, oldest: int) -> int:
        """Steps from `oldest` to `version` along the lineage (-1: count version numbers)."""
        return -1 if self._depth is None else max(0, self._depth(version) - self._depth(oldest))

    def take(self, version: int) -> Batch:
        """The next batch at policy `version`: the oldest `batch_groups` groups, or fewer
        once `batch_tokens` tokens are reached. Samples that grew stale while they waited,
        or whose version was rolled back meanwhile, are dropped (counted) here too."""
        batch = Batch()
        while self._pending and len(batch.groups) < self._batch_groups:
            if self._batch_tokens is not None and batch.tokens >= self._batch_tokens:
                break
            entry = self._pending.pop(0)
            newest = {s.sample_id: s.policy_version_max for g in entry.groups for s in g.samples}
            fresh: list[SampleArrays] = []
            too_old = "too_stale" if entry.session else "stale"
            dropped: dict[str, list[SampleArrays]] = {"rolled_back": [], too_old: []}
            for s in entry.samples:
                if self.rolled_back(s.policy_version_min, newest.get(s.sample_id, 0)):
                    dropped["rolled_back"].append(s)
                elif self.staleness.stale(
                    version,
                    s.policy_version_min,
                    self._horizon,
                    session=entry.session,
                    age=self._age(version, s.policy_version_min),
                ):
                    dropped[too_old].append(s)
                else:
                    fresh.append(s)
            for reason, samples in dropped.items():
                self.dropped[reason] += len(samples)
                self.dropped_tokens[reason] += sum(int(s.loss_mask.sum()) for s in samples)
                batch.stale.extend(s.sample_id for s in samples)
            batch.samples.extend(fresh)
            batch.groups.extend(entry.groups)
            batch.tokens += sum(len(s.token_ids) for s in fresh)
        return batch
