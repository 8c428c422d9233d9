"""The calculator demo's parts: tasks and splits, the harness's tool, the reward, the
pretraining data, and the committed base model."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "calculator"))
sys.path.insert(0, str(ROOT / "examples" / "tiny-model"))

import harness  # noqa: E402
import pretrain  # noqa: E402
import tasks  # noqa: E402

from harnessrl.services.reward.episode import Episode  # noqa: E402
from harnessrl.v1 import events_pb2 as pb  # noqa: E402

BASE = ROOT / "examples" / "tiny-model" / "calculator"


def test_splits_are_disjoint_deterministic_and_answers_right() -> None:
    train = tasks.problems("train", 300, seed=1)
    val = tasks.problems("val", 100, seed=0)
    assert {p.task_id for p in train}.isdisjoint({p.task_id for p in val})
    assert [p.task_id for p in tasks.problems("val", 100, seed=0)] == [p.task_id for p in val]
    for problem in train + val:
        assert harness.calculate(problem.expression) == str(problem.answer)
        assert problem.split == ("val" if problem in val else "train")
    line = tasks.task_line(val[0])
    assert line["split"] == "val" and "answer" not in json.dumps(line["input"])


def test_the_calculator_tool_answers_or_reports_an_error() -> None:
    assert harness.calculate("12 * (3 + 4)") == "84"
    assert harness.calculate("7 / 2") == "3.5"
    assert harness.run_tool('{"expression": "2 ** 10"}').startswith("error:")
    assert harness.run_tool('{"expression": "1 / 0"}').startswith("error:")
    assert harness.run_tool("not json").startswith("error:")


def _episode(result: object, answer: str = "391") -> Episode:
    event = pb.EpisodeFinished(
        episode_id="e",
        attempt=1,
        status=pb.EPISODE_STATUS_SUCCEEDED,
        result_json=json.dumps(result),
        task_metadata_json=json.dumps({"answer": answer}),
    )
    return Episode.from_event(event)


def test_the_reward_judges_the_last_number_of_the_reply() -> None:
    from reward import score  # examples/calculator/reward.py

    assert score(_episode({"answer": "The answer is 391.", "tools": 1})).value == 1.0
    assert score(_episode({"answer": "391 or 392?"})).value == 0.0
    assert score(_episode({"answer": "1,391"}, answer="1391")).value == 1.0
    empty = score(_episode({"answer": ""}))
    assert empty.value == 0.0 and "no_answer" in empty.flags


def test_pretraining_dialogues_are_imperfect_and_trained_only_on_assistant_tokens() -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(BASE)
    rng = random.Random(0)
    pool = tasks.problems("train", 50, seed=5)
    dialogues = [pretrain.dialogue(rng.choice(pool), rng) for _ in range(200)]
    tools = [d for d in dialogues if len(d) == 5]
    assert 0.3 < len(tools) / len(dialogues) < 0.8  # tool use and guesses both present
    guesses = [d for d in dialogues if len(d) == 3]
    assert all(d[-1]["content"].startswith("The answer is") for d in guesses)
    ids, mask = pretrain.encode(tokenizer, tools[0])
    trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    call = json.loads(tools[0][2]["tool_calls"][0]["function"]["arguments"])
    assert trained.startswith('<tool_call>\n{"name": "calculator"')
    assert call["expression"] in trained and tools[0][-1]["content"] in trained
    assert tools[0][3]["content"] + "\n</tool_response>" not in trained  # the tool's turn


@pytest.mark.parametrize("name", pretrain.TOKENIZER_FILES)
def test_the_base_model_shares_the_tiny_models_tokens(name: str) -> None:
    assert (BASE / name).read_bytes() == (BASE.parent / name).read_bytes()


def test_the_base_model_is_small_and_loads() -> None:
    from transformers import AutoModelForCausalLM

    size = sum(f.stat().st_size for f in BASE.iterdir())
    assert size <= 20 * 2**20
    model = AutoModelForCausalLM.from_pretrained(BASE)
    assert sum(p.numel() for p in model.parameters()) == 1_050_752
    recipe = json.loads((BASE / "training.json").read_text())
    assert recipe["recipe"]["steps"] == pretrain.Recipe().steps
