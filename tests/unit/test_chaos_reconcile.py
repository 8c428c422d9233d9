"""The chaos books: what counts as lost, doubled, conflicting or unaccounted."""

from __future__ import annotations

import json
from pathlib import Path

from harnessrl.apps.chaos.reconcile import Books, reconcile
from harnessrl.services.trainer.journal import StepJournal, read
from harnessrl.v1 import events_pb2 as pb


def call(episode: str, attempt: int, seq: int, tokens: list[int]) -> pb.ModelCall:
    return pb.ModelCall(
        episode_id=episode, attempt=attempt, group_id="g", seq=seq, completion_token_ids=tokens
    )


def finished(episode: str, attempt: int, calls: int | None) -> pb.EpisodeFinished:
    result = json.dumps({"answer": "4", "calls": calls}) if calls is not None else ""
    return pb.EpisodeFinished(
        episode_id=episode, attempt=attempt, group_id="g", final=True, result_json=result
    )


def test_books_balance_and_each_fault_is_counted(tmp_path: Path) -> None:
    books = Books()
    books.apply("task_submitted", pb.TaskSubmitted(group_id="g", group_size=3))
    for episode in ("a", "b", "c"):
        books.apply(
            "episode_started", pb.EpisodeStarted(episode_id=episode, attempt=1, group_id="g")
        )
    # a: two calls answered, both captured (one delivered twice after a restart: same tokens).
    for event in (call("a", 1, 0, [1]), call("a", 1, 1, [2]), call("a", 1, 1, [2])):
        books.apply("model_call", event)
    books.apply("episode_finished", finished("a", 1, 2))
    # b: three answered, two captured, and seq 0 handed out twice with different tokens.
    for event in (call("b", 1, 0, [1]), call("b", 1, 0, [9]), call("b", 1, 1, [3])):
        books.apply("model_call", event)
    books.apply("episode_finished", finished("b", 1, 3))
    # c: its first attempt was killed without a result after one answer (its progress file),
    # which was captured; the retry never finished.
    books.apply("model_call", call("c", 1, 0, [4]))
    books.progress[("c", 1)] = 1
    books.apply("episode_finished", finished("c", 1, None))
    books.apply("episode_started", pb.EpisodeStarted(episode_id="c", attempt=2, group_id="g"))
    sample = pb.Sample(sample_id="a/1/0", loss_mask=[False, True, True])
    books.apply("group_samples", pb.GroupSamples(group_id="g", samples=[sample]))
    journal = StepJournal(tmp_path, resumed_from=0)
    journal.record(1, 1, ["a/1/0"])
    journal.record(2, 2, ["a/1/0"])
    figures = reconcile(books, read(tmp_path / "steps.jsonl"))
    assert figures["calls_answered"] == 6
    assert figures["calls_captured"] == 5  # distinct (episode, attempt, seq)
    assert figures["calls_lost"] == 1  # b: 3 answered, 2 captured
    assert figures["calls_conflicting"] == 1
    assert figures["attempts_without_result"] == 2  # c/1 killed, c/2 never finished
    assert figures["episodes"] == 3 and figures["episodes_retried"] == 1
    assert figures["episodes_unaccounted"] == 1  # c's last attempt has no EpisodeFinished
    assert figures["samples_trained"] == 2 and figures["samples_trained_twice"] == 1
    assert figures["tokens_trained"] == 4 and figures["tokens_captured"] == 5


def test_calls_a_killed_harness_recorded_as_answered_count_and_can_be_lost() -> None:
    books = Books()
    books.apply("task_submitted", pb.TaskSubmitted(group_id="g", group_size=1))
    books.apply("episode_started", pb.EpisodeStarted(episode_id="a", attempt=1, group_id="g"))
    books.apply("model_call", call("a", 1, 0, [1]))
    books.progress[("a", 1)] = 2  # the second answer never reached hrl.calls
    books.apply("episode_finished", finished("a", 1, None))
    books.apply("episode_started", pb.EpisodeStarted(episode_id="a", attempt=2, group_id="g"))
    books.apply("model_call", call("a", 2, 0, [1]))
    books.apply("episode_finished", finished("a", 2, 1))
    figures = reconcile(books, [])
    assert figures["calls_answered"] == 3 and figures["calls_captured"] == 2
    assert figures["calls_lost"] == 1
    assert figures["attempts_without_result"] == 1 and figures["episodes_unaccounted"] == 0


def test_an_episode_that_never_started_is_unaccounted() -> None:
    books = Books()
    books.apply("task_submitted", pb.TaskSubmitted(group_id="g", group_size=2))
    books.apply("episode_started", pb.EpisodeStarted(episode_id="a", attempt=1, group_id="g"))
    books.apply("episode_finished", finished("a", 1, 1))
    assert reconcile(books, [])["episodes_unaccounted"] == 1
