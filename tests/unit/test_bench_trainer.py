"""`harnessrl bench trainer` at toy sizes on the tiny model: it runs end to end and prints
its JSON line. Timings are not asserted (they belong to the benchmark's output)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harnessrl.apps.cli import main
from tests.helpers import FULL

SMALL = [
    "--device",
    "cpu",
    "--batches",
    "2",
    "--samples",
    "3",
    "--min-len",
    "16",
    "--max-len",
    "40",
    "--micro-batch-tokens",
    "64",
    "--seed",
    "5",
]


def test_bench_trainer_json_prints_one_line_with_the_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "trainer", "--json", *SMALL]) == 0
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    for key in ("trainer_step_s", "bare_step_s", "ratio", "tokens_per_s", "bare_tokens_per_s"):
        assert result[key] > 0, key
    assert result["achieved_tflops"] > 0
    assert result["mfu"] is None and result["peak_tflops"] is None  # no peak on CPU
    assert result["device"] == "cpu"
    assert result["threads"] >= 1
    assert result["model_size"] == "tiny"
    assert 500_000 < result["model_params"] < 2_000_000
    assert 0.0 <= result["padding_fraction"] < 1.0
    assert (result["batches"], result["measured_batches"], result["samples_per_batch"]) == (2, 1, 3)
    assert 3 * 16 <= result["tokens_per_batch"] <= 3 * 40
    assert (result["min_len"], result["max_len"], result["micro_batch_tokens"]) == (16, 40, 64)
    assert "batch 1/2 (warm-up)" in out.err and "batch 2/2:" in out.err


def test_bench_trainer_without_json_prints_a_summary_then_the_json_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "trainer", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.strip().startswith("ratio:") for line in lines[:-1])
    assert json.loads(lines[-1])["samples_per_batch"] == 3


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        (["--batches", "1"], "--batches must be >= 2"),
        (["--model-size", "0.5b"], "--model-size 0.5b needs CUDA"),
    ],
)
def test_bench_trainer_refuses_a_run_it_cannot_measure(
    extra: list[str], reason: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "trainer", "--json", *SMALL, *extra]) == 2
    assert reason in capsys.readouterr().err


def test_bench_trainer_trains_lora_adapters_on_a_model_built_from_a_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import Qwen3Config

    Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=512,
    ).save_pretrained(tmp_path)
    argv = ["bench", "trainer", "--json", *SMALL, "--model-config", str(tmp_path), "--lora"]
    assert main([*argv, "--lora-rank", "4"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    # 2 layers x 7 projections, rank 4: r * (in + out) each
    per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
    assert result["trained_params"] == 2 * per_layer
    assert result["lora_rank"] == 4
    assert result["model_params"] > result["trained_params"]


@pytest.mark.skipif(
    not FULL,
    reason="two torchrun launches: make test-full (test_trainer_sharded.py checks the same update)",
)
def test_bench_trainer_sharded_halves_the_state_per_rank_and_changes_no_weight(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "trainer", "--json", "--sharded", *SMALL]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["ranks"] == 2
    single, per_rank = result["single_state_bytes"], result["sharded_state_bytes_per_rank"]
    assert all(0.45 * single <= b <= 0.55 * single for b in per_rank)
    assert result["max_abs_diff"] <= 1e-5
