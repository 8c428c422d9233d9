"""`harnessrl bench samples` at toy sizes: it runs end to end and prints its JSON line.

Timings are not asserted (they belong to the benchmark's output, not to tests).
"""

from __future__ import annotations

import json

import pytest

from harnessrl.apps.cli import main

SMALL = ["--groups", "2", "--rounds", "1", "--episodes", "2", "--calls", "2", "--seed", "3"]


def test_bench_samples_json_prints_one_line_with_the_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "samples", "--json", *SMALL]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    for key in ("tokens_per_s", "groups_per_s", "concat_tokens_per_s", "ratio"):
        assert result[key] > 0, key
    assert result["tokens_counted"] == "sample_token_ids"
    assert (result["groups"], result["rounds"]) == (2, 1)
    assert (result["episodes_per_group"], result["calls_per_episode"]) == (2, 2)
    # two calls: the last prompt holds the first call's prompt and completion
    assert result["sample_tokens_per_group"] > 2 * (1000 + 100 + 50 + 100)
    assert set(result["breakdown"]) == {"decode", "join", "build", "encode"}
    assert "round 1/1" in out.err
    # The episode shapes of real harnesses: chains hold no token more than they need.
    shapes = result["shapes"]
    assert set(shapes) == {"linear", "thinking", "sub_agent", "compaction", "side_calls"}
    for name, figures in shapes.items():
        assert figures["sequence_tokens_over_minimal"] == 1.0, name
        assert figures["calls_per_s"] > 0
    per_episode = {name: figures["sequences_per_episode"] for name, figures in shapes.items()}
    assert per_episode == {
        "linear": 1,
        "thinking": 4,
        "sub_agent": 2,
        "compaction": 2,
        "side_calls": 129,
    }


def test_bench_samples_without_json_prints_a_summary_then_the_json_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "samples", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 1
    assert any(line.strip().startswith("ratio:") for line in lines[:-1])
    assert json.loads(lines[-1])["groups"] == 2
