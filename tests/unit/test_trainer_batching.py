"""The trainer's batcher: staleness is judged when a sample arrives and again when it is used."""

from __future__ import annotations

from harnessrl.trust.batching import Batcher, Staleness
from harnessrl.v1 import events_pb2 as pb


def group(group_id: str, version: int) -> pb.GroupSamples:
    sample = pb.Sample(
        sample_id=f"{group_id}/0",
        episode_id=f"{group_id}-0",
        token_ids=[1, 2, 3],
        loss_mask=[False, True, True],
        behavior_logprobs=[0.0, -0.5, -0.5],
        advantage=1.0,
        temperature=1.0,
        policy_version_min=version,
        policy_version_max=version,
    )
    return pb.GroupSamples(group_id=group_id, samples=[sample])


def test_a_sample_that_grew_stale_while_waiting_is_dropped_when_the_batch_is_taken() -> None:
    batcher = Batcher(batch_groups=1, batch_tokens=None, max_staleness=2)
    assert batcher.add(group("old", 3), version=4, trained=set())  # 1 behind: taken
    assert batcher.add(group("new", 5), version=5, trained=set())
    assert not batcher.add(group("too-old", 1), version=5, trained=set())  # 4 behind
    assert batcher.dropped["stale"] == 1
    assert batcher.dropped_tokens["stale"] == 2  # its loss-mask tokens
    first = batcher.take(version=6)  # "old" is 3 behind now
    assert [g.group_id for g in first.groups] == ["old"]
    assert first.samples == [] and first.tokens == 0
    assert batcher.dropped["stale"] == 2
    assert batcher.dropped_tokens["stale"] == 4
    second = batcher.take(version=6)
    assert [s.sample_id for s in second.samples] == ["new/0"] and second.tokens == 3


def test_one_rule_decides_staleness_at_arrival_and_when_taken() -> None:
    """A sample below the ledger's horizon is stale however few versions behind it is, and
    the horizon a batcher was told at arrival still holds when the batch is taken."""
    rule = Staleness(max_versions=2)
    assert not rule.stale(version=5, oldest=3)
    assert rule.stale(version=5, oldest=2)
    assert rule.stale(version=5, oldest=4, horizon=5)
    batcher = Batcher(batch_groups=2, batch_tokens=None, max_staleness=10)
    assert batcher.add(group("a", 4), version=5, trained=set())
    assert not batcher.add(group("b", 3), version=5, trained=set(), horizon=4)
    assert batcher.take(version=5).samples[0].sample_id == "a/0"


def test_a_production_sessions_samples_have_a_staleness_bound_of_their_own() -> None:
    """Feedback arrives hours later: a session's sample may be many versions old and still
    train (the clipped importance ratio corrects it); past its own bound it is dropped as
    too_stale, its tokens counted under that reason."""
    batcher = Batcher(batch_groups=4, batch_tokens=None, max_staleness=2, max_session_staleness=8)
    session = group("s.support.t-1", 1)
    session.estimator = "session_baseline"
    assert batcher.add(session, version=8, trained=set())  # 7 behind: within 8
    assert not batcher.add(group("task", 1), version=8, trained=set())  # a task's: stale
    late = group("s.support.t-2", 1)
    late.estimator = "session_baseline"
    assert not batcher.add(late, version=10, trained=set())  # 9 behind
    assert batcher.dropped_tokens == {"stale": 2, "too_stale": 2}
    taken = batcher.take(version=10)  # the first grew too old while it waited
    assert taken.samples == [] and taken.stale == ["s.support.t-1/0"]
    assert batcher.dropped_tokens["too_stale"] == 4
    assert batcher.staleness.remembered == 8


def test_after_a_rewind_staleness_counts_the_steps_along_the_lineage() -> None:
    """The trainer rewound from version 25 to stable 0 (a canary rollback): version 26 was
    trained from 0, so a sample of stable 0 is one step behind it, not 26."""
    depths = {0: 0, **{v: v for v in range(1, 26)}, 26: 1, 27: 2, 28: 3}
    batcher = Batcher(batch_groups=1, batch_tokens=None, max_staleness=2, depth=depths.__getitem__)
    assert batcher.add(group("stable-arm", 0), version=26, trained=set())
    assert batcher.add(group("later", 0), version=27, trained=set())
    assert [s.sample_id for s in batcher.take(version=27).samples] == ["stable-arm/0"]
    assert batcher.take(version=28).stale == ["later/0"]  # three steps past 0 now
