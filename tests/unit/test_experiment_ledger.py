"""The experiment's ledger (events -> evaluation and training figures) and metrics parsing."""

from __future__ import annotations

from harnessrl.apps.experiment.ledger import TRAIN, VAL_AFTER, VAL_BEFORE, RunLedger
from harnessrl.apps.experiment.scrape import parse
from harnessrl.v1 import events_pb2 as pb


def finished(episode: str, group: str, attempt: int = 1, final: bool = True) -> pb.EpisodeFinished:
    event = pb.EpisodeFinished(episode_id=episode, group_id=group, attempt=attempt, final=final)
    event.finished_at.FromSeconds(1000)
    return event


def reward(
    episode: str, group: str, value: float, attempt: int = 1, missing: bool = False
) -> pb.RewardAssigned:
    return pb.RewardAssigned(
        episode_id=episode, group_id=group, attempt=attempt, value=value, missing=missing
    )


def test_a_group_is_done_when_each_episode_has_its_final_attempts_reward() -> None:
    ledger = RunLedger()
    ledger.submitted("g1", "mul-3-4", VAL_BEFORE, 2)
    ledger.apply("episode_started", pb.EpisodeStarted(episode_id="e1", group_id="g1"), 1.0)
    ledger.apply("episode_finished", finished("e1", "g1", final=False), 2.0)
    ledger.apply("reward_assigned", reward("e1", "g1", 0.0), 2.0)
    assert ledger.outstanding(VAL_BEFORE) == 1  # attempt 1 was not final: a retry follows
    ledger.apply("episode_finished", finished("e1", "g1", attempt=2), 3.0)
    ledger.apply("reward_assigned", reward("e1", "g1", 1.0, attempt=2), 3.0)
    assert ledger.outstanding(VAL_BEFORE) == 1  # the second episode has not been seen
    ledger.apply("episode_finished", finished("e2", "g1"), 3.0)
    ledger.apply("reward_assigned", reward("e2", "g1", 5.0, missing=True), 3.0)
    assert ledger.outstanding(VAL_BEFORE) == 0
    evaluation = ledger.evaluation(VAL_BEFORE)
    assert evaluation["success"] == 0.5  # the retry's 1.0 and a missing reward's 0
    assert evaluation["by_kind"] == {"mul": {"n": 2, "success": 0.5}}
    assert ledger.evaluation(VAL_AFTER)["episodes"] == 0


def test_events_of_groups_the_experiment_did_not_submit_are_ignored() -> None:
    ledger = RunLedger()
    ledger.apply("episode_finished", finished("x", "other"), 1.0)
    ledger.apply("group_samples", pb.GroupSamples(group_id="other"), 1.0)
    assert ledger.groups == {}
    assert ledger.emitted == []


def test_train_figures_steps_and_engines() -> None:
    ledger = RunLedger()
    ledger.submitted("g", "add-1-2", TRAIN, 1)
    call = pb.ModelCall(
        episode_id="e",
        group_id="g",
        policy_version=3,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
    )
    ledger.apply("model_call", call, 1001.0)
    ledger.apply("episode_finished", finished("e", "g"), 1002.0)
    ledger.apply("reward_assigned", reward("e", "g", 1.0), 1002.0)
    books = pb.TokenBooks(captured=9, trained=5, dropped={"retried": 3, "truncated": 1})
    merge = pb.MergeStats(calls=2, segments=1, break_side_chain=1)
    samples = pb.GroupSamples(group_id="g", merge=merge, books=books)
    ledger.apply("group_samples", samples, 1003.0)
    ledger.apply("policy_version", pb.PolicyVersion(version=4, step=4), 1004.0)
    assert ledger.step == 4 and ledger.version == 4
    assert not ledger.engines_serve(4)
    ledger.apply("policy_loaded", pb.PolicyLoaded(version=4, engine="a", ok=True), 1005.0)
    ledger.apply("policy_loaded", pb.PolicyLoaded(version=5, engine="a", ok=False), 1005.0)
    assert ledger.engines_serve(4) and not ledger.engines_serve(5)
    assert ledger.train_episodes(since=990.0) == [{"t": 10.0, "reward": 1.0, "version": 3}]
    assert ledger.train_calls(since=1000.0) == [
        {"t": 1.0, "prompt_tokens": 3, "completion_tokens": 2}
    ]
    assert ledger.merge["calls"] == 2 and ledger.merge["segments"] == 1
    assert ledger.merge["break_side_chain"] == 1
    assert (ledger.merge["tokens_captured"], ledger.merge["tokens_trained"]) == (9, 5)
    assert ledger.merge["tokens_dropped_retried"] == 3
    assert ledger.merge["tokens_dropped_truncated"] == 1
    assert ledger.sampled_episodes() == ["e"]


METRICS = """\
# TYPE harnessrl_trainer_loss gauge
harnessrl_trainer_loss 0.25
# TYPE harnessrl_trainer_entropy gauge
harnessrl_trainer_entropy 1.5
# TYPE harnessrl_trainer_sample_staleness histogram
harnessrl_trainer_sample_staleness_bucket{le="0.0"} 3.0
harnessrl_trainer_sample_staleness_bucket{le="1.0"} 7.0
harnessrl_trainer_sample_staleness_bucket{le="2.0"} 7.0
harnessrl_trainer_sample_staleness_bucket{le="+Inf"} 8.0
harnessrl_trainer_sample_staleness_count 8.0
harnessrl_trainer_sample_staleness_sum 6.0
# TYPE harnessrl_trainer_samples_dropped counter
harnessrl_trainer_samples_dropped_total{reason="stale"} 2.0
# TYPE harnessrl_samples_groups counter
harnessrl_samples_groups_total{outcome="emitted"} 5.0
harnessrl_samples_groups_total{outcome="zero_variance"} 4.0
"""


def test_parse_reads_gauges_histogram_and_counters() -> None:
    parsed = parse(METRICS)
    assert parsed["step"] == {"loss": 0.25, "entropy": 1.5}
    assert parsed["staleness"] == {"0": 3, "1": 4, "more": 1}
    assert parsed["dropped"] == {"stale": 2}
    assert parsed["groups"] == {"emitted": 5, "zero_variance": 4}
