"""The stand-in engine of `bench load` plays the calculator harness's episodes as a model
would, and answers in the engine dialect the gateway asks for, only when asked.

The harness runs unchanged on the real openai SDK; only its HTTP transport is in memory,
handing each request body to the stand-in's `answer()`.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "calculator"))

import harness  # noqa: E402
import tasks  # noqa: E402

from harnessrl.bench.calculator_standin import answer, expression  # noqa: E402


def sdk_client(bodies: list[dict[str, Any]]) -> openai.OpenAI:
    """A real SDK client whose transport answers with the stand-in, in memory."""
    http = importlib.import_module(openai.DefaultHttpxClient.__mro__[1].__module__.split(".")[0])

    def handle(request: Any) -> Any:
        body = json.loads(request.content)
        bodies.append(body)
        return http.Response(200, json=answer(body))

    client = openai.DefaultHttpxClient(transport=http.MockTransport(handle))
    return openai.OpenAI(base_url="http://standin/v1", api_key="k", http_client=client)


def test_standin_episodes_take_two_to_four_calls_and_answer_right() -> None:
    lengths: Counter[int] = Counter()
    for problem in tasks.problems("train", 60, seed=4):
        bodies: list[dict[str, Any]] = []
        result = harness.solve(sdk_client(bodies), problem.question)
        assert result["answer"].endswith(f"The answer is {problem.answer}."), result
        assert result["calls"] == len(bodies) == result["tools"] + 1
        lengths[result["calls"]] += 1
    assert set(lengths) == {2, 3, 4}


def test_the_harness_records_each_answer_beside_its_output(tmp_path: Path) -> None:
    """`progress.json` is rewritten after each answer: what a killed run leaves behind."""
    problem = tasks.problems("train", 1, seed=4)[0]
    seen: list[int] = []
    progress = tmp_path / harness.PROGRESS
    write = harness._progress(progress)

    def answered(calls: int) -> None:
        write(calls)
        seen.append(json.loads(progress.read_text())["calls"])

    result = harness.solve(sdk_client([]), problem.question, answered)
    assert seen == list(range(1, result["calls"] + 1))
    assert sorted(p.name for p in tmp_path.iterdir()) == [harness.PROGRESS]  # no .tmp left


def test_standin_reads_every_phrasing_of_the_tasks() -> None:
    for problem in tasks.problems("val", 200, seed=0):
        assert expression(problem.question) == (str(problem.a), problem.op, str(problem.b))


def test_standin_gives_token_ids_and_logprobs_only_when_asked() -> None:
    messages = [{"role": "user", "content": "What is 12 times 3?"}]
    plain = answer({"model": "m", "messages": messages})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    assert plain["choices"][0]["logprobs"] is None
    engine = answer(
        {"model": "m", "messages": messages, "return_token_ids": True, "logprobs": True}
    )
    choice = engine["choices"][0]
    assert engine["prompt_token_ids"] and choice["token_ids"]
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert all(isinstance(e["logprob"], float) for e in choice["logprobs"]["content"])
    call = choice["message"]["tool_calls"][0]["function"]
    assert (call["name"], json.loads(call["arguments"])) == ("calculator", {"expression": "12 * 3"})
