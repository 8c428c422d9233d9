"""Reward logic without a broker: what a reward may return, the episode it sees, the
built-in answer reward, and how failures become missing rewards."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from harnessrl.config import load_config
from harnessrl.services.reward.answer import AnswerReward, matches
from harnessrl.services.reward.config import AnswerSettings, RewardConfig, RewardSection
from harnessrl.services.reward.episode import Episode, InvalidScore, Score, to_score
from harnessrl.services.reward.scoring import CallPolicy, assign
from harnessrl.services.reward.sources import FunctionScorer, load_entrypoint, make_scorer
from harnessrl.v1 import events_pb2 as pb


def event(**fields: Any) -> pb.EpisodeFinished:
    base: dict[str, Any] = {
        "episode_id": "g-0",
        "attempt": 2,
        "group_id": "g",
        "task_id": "t",
        "mode": pb.MODE_VAL,
        "status": pb.EPISODE_STATUS_SUCCEEDED,
        "result_json": json.dumps({"answer": "42"}),
        "task_input_json": json.dumps({"question": "6 * 7?"}),
        "task_metadata_json": json.dumps({"answer": "42"}),
        "final": True,
    }
    return pb.EpisodeFinished(**(base | fields))


def test_to_score_accepts_numbers_scores_and_mappings() -> None:
    assert to_score(1) == Score(1.0)
    assert to_score(np.float32(0.5)) == Score(0.5)
    assert to_score({"value": 1, "components": {"a": 2}, "flags": ["x", "x"]}) == Score(
        1.0, {"a": 2.0}, ("x",)
    )
    assert to_score(Score(0.0, {"b": 1}, ("y",), "m")) == Score(0.0, {"b": 1.0}, ("y",), "m")


@pytest.mark.parametrize(
    ("returned", "words"),
    [
        (math.nan, "non_finite"),
        (math.inf, "non_finite"),
        (Score(1.0, {"part": math.nan}), "non_finite"),
        (True, "expected a number"),
        ("1.0", "expected a number"),
        (None, "expected a number"),
        ({"components": {}}, "score.value: required"),
        ({"value": 1, "bonus": 2}, "unknown fields"),
        ({"value": 1, "flags": "tests_modified"}, "score.flags"),
        (Score(1.0, {"": 1.0}), "score.components"),
    ],
)
def test_to_score_refuses_what_is_not_a_usable_score(returned: Any, words: str) -> None:
    with pytest.raises(InvalidScore, match=words):
        to_score(returned)


def test_episode_from_event_parses_what_the_controller_reported(tmp_path: Path) -> None:
    finished = event(artifacts_uri=tmp_path.as_uri(), exit_code=0)
    finished.started_at.FromSeconds(100)
    finished.finished_at.FromSeconds(112)
    episode = Episode.from_event(finished)
    assert (episode.mode, episode.status, episode.exit_code) == ("val", "succeeded", 0)
    assert episode.result == {"answer": "42"} and episode.task_metadata == {"answer": "42"}
    assert episode.artifacts_dir == tmp_path and episode.duration_s == 12.0
    assert Episode.from_event(event(artifacts_uri="k8s://ns/jobs/x")).artifacts_dir is None
    assert Episode.from_event(event()).exit_code is None


def test_a_truncated_or_malformed_result_is_no_result() -> None:
    assert (
        Episode.from_event(event(result_json='{"answer": "4', result_truncated=True)).result is None
    )
    assert Episode.from_event(event(result_json="not json")).result is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"episode_id": ""}, "episode_id: required"),
        ({"task_metadata_json": "[1]"}, "task_metadata_json: not a JSON object"),
        ({"task_metadata_json": "{"}, "task_metadata_json: not JSON"),
        ({"task_input_json": "{"}, "task_input_json: not JSON"),
    ],
)
def test_an_unusable_event_is_refused_naming_the_field(fields: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Episode.from_event(event(**fields))


@pytest.mark.parametrize(
    ("answer", "expected", "how", "result"),
    [
        ("42", "42", "auto", True),
        ("The answer is 42.", "42", "auto", True),
        ("41 or 42? I say 41", "42", "auto", False),
        ("1,234.5", 1234.5, "auto", True),
        ("0.30000000000000004", "0.3", "auto", True),
        ("42%", "42%", "auto", True),
        ("The Eiffel Tower!", "eiffel tower", "auto", True),
        ("Eiffel", "eiffel tower", "auto", False),
        ("42.0", "42", "exact", False),
        ("forty-two", "42", "numeric", False),
        ("  Paris ", "paris", "text", True),
    ],
)
def test_answer_matching(answer: Any, expected: Any, how: str, result: bool) -> None:
    assert matches(answer, expected, how, 1e-6, 1e-9) is result


def test_builtin_answer_scores_the_answer_and_nothing_the_harness_claims() -> None:
    reward = AnswerReward(AnswerSettings())
    assert reward(Episode.from_event(event())) == Score(1.0, {"correct": 1.0})
    cheat = event(result_json=json.dumps({"answer": "7", "reward": 1.0, "correct": True}))
    assert reward(Episode.from_event(cheat)).value == 0.0
    bare = event(result_json="42")
    assert reward(Episode.from_event(bare)).value == 1.0
    none = reward(Episode.from_event(event(result_json="")))
    assert (none.value, none.flags) == (0.0, ("no_answer",))


def test_builtin_answer_needs_the_expected_answer_in_the_metadata() -> None:
    reward = AnswerReward(AnswerSettings())
    with pytest.raises(ValueError, match=r"task metadata\.answer: required"):
        reward(Episode.from_event(event(task_metadata_json="{}")))
    with pytest.raises(ValueError, match=r"task metadata\.match"):
        reward(Episode.from_event(event(task_metadata_json='{"answer": 1, "match": "fuzzy"}')))


class Flaky:
    source = "test:flaky"

    def __init__(self, failures: int, error: Exception) -> None:
        self.calls = 0
        self.failures = failures
        self.error = error

    async def score(self, episode: Episode) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return 0.75

    async def close(self) -> None:
        pass


POLICY = CallPolicy(timeout_s=0.5, max_retries=2, backoff_s=0.001)


async def test_transient_errors_are_retried_up_to_the_limit() -> None:
    episode = Episode.from_event(event())
    scorer = Flaky(2, ConnectionError("down"))
    assigned = await assign(scorer, episode, POLICY)
    assert (assigned.value, assigned.missing, scorer.calls) == (0.75, False, 3)
    assert (assigned.episode_id, assigned.attempt, assigned.group_id) == ("g-0", 2, "g")
    scorer = Flaky(3, TimeoutError("judge slow"))  # raised by the reward: transient
    assigned = await assign(scorer, episode, POLICY)
    assert assigned.missing and scorer.calls == 3 and list(assigned.flags) == ["reward_error"]


async def test_other_errors_are_not_retried() -> None:
    scorer = Flaky(1, KeyError("answer"))
    assigned = await assign(scorer, Episode.from_event(event()), POLICY)
    assert assigned.missing and scorer.calls == 1
    assert assigned.message == "reward failed: KeyError: 'answer'"


async def test_a_sync_reward_that_hangs_is_missing_at_the_timeout_and_counted() -> None:
    def sleepy(episode: Episode) -> float:
        time.sleep(1.0)
        return 1.0

    scorer = FunctionScorer("entrypoint:x:sleepy", sleepy, threads=2)
    started = time.monotonic()
    assigned = await assign(scorer, Episode.from_event(event()), POLICY)
    assert time.monotonic() - started < 0.9  # not retried: the timeout is final
    assert assigned.missing and list(assigned.flags) == ["reward_timeout"]
    assert scorer.running_in_threads == 1  # the thread runs on; it is counted
    await asyncio.sleep(0.7)
    assert scorer.running_in_threads == 0
    await scorer.close()


async def test_async_and_sync_functions_and_async_callables_all_score() -> None:
    class Judge:
        async def __call__(self, episode: Episode) -> float:
            return 0.5

    async def judge(episode: Episode) -> dict[str, Any]:
        return {"value": 1, "flags": ["ok"]}

    episode = Episode.from_event(event())
    for function, value in ((Judge(), 0.5), (judge, 1.0), (lambda e: 2, 2.0)):
        scorer = FunctionScorer("entrypoint:x:y", function, threads=1)
        assert (await assign(scorer, episode, POLICY)).value == value
        await scorer.close()


def test_entrypoints_are_loaded_or_refused_with_the_reason() -> None:
    assert load_entrypoint("tests.integration.workers.rewards:answer_length").__name__ == (
        "answer_length"
    )
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_entrypoint("no_such_module:f")
    with pytest.raises(ValueError, match="has no 'nope'"):
        load_entrypoint("json:nope")
    with pytest.raises(ValueError, match="not entrypoint:<module>:<function>"):
        load_entrypoint("json")
    with pytest.raises(ValueError, match="not callable"):
        load_entrypoint("json:__doc__")


RESOLVE_FROM_ELSEWHERE = """
import asyncio, json, sys
from harnessrl.config import load_config
from harnessrl.services.reward.config import RewardConfig
from harnessrl.services.reward.episode import Episode
from harnessrl.services.reward.sources import make_scorer
from harnessrl.v1 import events_pb2 as pb

section = load_config(RewardConfig, sys.argv[1]).reward
scorer = make_scorer(section)
event = pb.EpisodeFinished(
    episode_id="g-0", attempt=1, group_id="g", task_id="t", final=True,
    status=pb.EPISODE_STATUS_SUCCEEDED, result_json=json.dumps({"answer": "It is 42."}),
    task_metadata_json=json.dumps({"answer": "42", "match": "numeric"}),
)
score = asyncio.run(scorer.score(Episode.from_event(event)))
print(json.dumps({"dir": str(section.entrypoint_dir), "value": score.value}))
"""


def test_an_entrypoint_module_resolves_from_the_config_files_project_in_any_directory(
    tmp_path: Path,
) -> None:
    """`harnessrl up --config /abs/examples/up.yaml` run outside the repository: the
    calculator reward (entrypoint:examples.calculator.reward:score) is not on the Python
    path there; it is found from the config file's directory's parent, as the rule says."""
    config = Path(__file__).resolve().parents[2] / "examples" / "up.yaml"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", RESOLVE_FROM_ELSEWHERE, str(config)],
        cwd=elsewhere,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"dir": str(config.parent), "value": 1.0}


def test_an_entrypoint_module_found_nowhere_is_refused_stating_the_rule(tmp_path: Path) -> None:
    config = tmp_path / "configs" / "harnessrl.yaml"
    config.parent.mkdir()
    config.write_text("reward:\n  source: entrypoint:no_such_rewards.mine:score\n")
    section = load_config(RewardConfig, config).reward
    assert section.entrypoint_dir == config.parent
    with pytest.raises(ValueError) as refused:
        make_scorer(section)
    message = str(refused.value)
    assert message.startswith("reward.source: cannot import 'no_such_rewards.mine'")
    assert "from the Python path, else from the config file's directory" in message
    assert f"none of {config.parent} and its parents holds no_such_rewards/" in message
    # A module that is there but fails inside is its own error, not the rule's.
    inside = r"cannot import 'json\.nope': No module named 'json\.nope'$"
    with pytest.raises(ValueError, match=inside):
        load_entrypoint("json.nope:f", tmp_path)


def test_the_source_setting_is_checked() -> None:
    with pytest.raises(ValidationError, match="must be builtin"):
        RewardSection(source="http://judge")
    with pytest.raises(ValueError, match="unknown builtin 'bleu'"):
        make_scorer(RewardSection(source="builtin:bleu"))
    with pytest.raises(ValueError, match="not grpc:<host>:<port>"):
        make_scorer(RewardSection(source="grpc:judge"))
    assert make_scorer(RewardSection(source="builtin:answer")).source == "builtin:answer"
