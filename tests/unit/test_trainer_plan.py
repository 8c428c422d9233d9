"""`harnessrl trainer plan` and the trainer's start-up size check (services/trainer/memory_plan.py,
its figures from memory_estimate.py and model_shape.py).

Parameter counts are checked against real models; the activation estimate against what
autograd actually saves on this CPU (saved_tensors_hooks). Memory on a GPU is not measured
here: there is none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

from harnessrl.apps.cli import build_parser, main
from harnessrl.services.trainer import cli as trainer_cli
from harnessrl.services.trainer.config import LoraSection, ShardingSection, TrainerSection
from harnessrl.services.trainer.memory_estimate import GiB, plan
from harnessrl.services.trainer.memory_plan import check_fits
from harnessrl.services.trainer.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-model"


def small_qwen3(**overrides: Any) -> Qwen3Config:
    """A small untied Qwen3 (GQA, q/k norms, head_dim apart from hidden / heads)."""
    shape: dict[str, Any] = {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 48,
        "vocab_size": 1024,
        "tie_word_embeddings": False,
    }
    return Qwen3Config(**{**shape, **overrides})


def nine_b(directory: Path) -> Path:
    """A 9B-shaped Qwen3 config.json (the 8B's blocks, 40 of them)."""
    small_qwen3(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=40,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
    ).save_pretrained(directory)
    return directory


def test_parameter_count_matches_the_tiny_model_counting_tied_embeddings_once() -> None:
    model = AutoModelForCausalLM.from_pretrained(TINY)
    result = plan(TINY, TrainerSection(model=TINY), 1, None)
    assert result.shape.total_params == sum(p.numel() for p in model.parameters())
    # Its head shares the embedding: the state dict lists the matrix twice, the plan once.
    assert result.shape.total_params < sum(t.numel() for t in model.state_dict().values())
    assert result.trainable_params == result.shape.total_params


def test_parameter_count_matches_an_untied_qwen3_from_its_config_json(tmp_path: Path) -> None:
    config = small_qwen3()
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    result = plan(tmp_path / "config.json", TrainerSection(), 1, None)
    assert result.shape.total_params == sum(p.numel() for p in model.parameters())
    assert result.shape.architecture == "Qwen3ForCausalLM"
    assert result.shape.blocks == 3


def test_fsdp_divides_weights_gradients_and_optimizer_by_the_ranks() -> None:
    settings = TrainerSection(sharding=ShardingSection(strategy="fsdp"))
    one, two = (plan(small_qwen3(), settings, n, None) for n in (1, 2))
    for name in ("weights", "gradients", "optimizer", "step_temporaries"):
        assert getattr(two, name) == getattr(one, name) // 2, name
    assert two.activations_full == one.activations_full  # every rank runs its micro-batch
    assert two.sharded and not one.sharded
    replicated = plan(
        small_qwen3(), TrainerSection(sharding=ShardingSection(strategy="replicate")), 2, None
    )
    assert replicated.weights == one.weights and replicated.optimizer == one.optimizer


def test_lora_trains_rank_times_in_plus_out_per_targeted_linear() -> None:
    h, i, q, kv, layers, rank = 256, 768, 8 * 48, 2 * 48, 3, 8
    per_block = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)  # q k v o gate up down
    settings = TrainerSection(lora=LoraSection(rank=rank))
    result = plan(small_qwen3(), settings, 1, None)
    assert result.trainable_params == rank * per_block * layers
    total = result.shape.total_params
    assert result.weights == 2 * total + 4 * result.trainable_params  # bf16 base on CUDA
    assert result.optimizer == 8 * result.trainable_params
    only_q = TrainerSection(lora=LoraSection(rank=rank, target_modules=("q_proj",)))
    assert plan(small_qwen3(), only_q, 1, None).trainable_params == rank * (h + q) * layers


def test_check_fits_refuses_a_9b_model_on_one_80_gib_gpu_and_names_the_figures(
    tmp_path: Path,
) -> None:
    settings = TrainerSection(model=nine_b(tmp_path), gpu_memory_gib=80)
    result = plan(settings.model, settings, 1, 80 * GiB, device_type="cpu")
    with pytest.raises(ValueError, match="does not fit") as raised:
        check_fits(settings, 1, torch.device("cpu"))
    message = str(raised.value)
    for figure in (result.total, result.weights, result.optimizer, result.usable or 0):
        assert f"{figure / GiB:.2f}" in message
    assert "80.00 GiB" in message


def test_check_fits_passes_the_9b_model_on_eight_80_gib_gpus(tmp_path: Path) -> None:
    settings = TrainerSection(
        model=nine_b(tmp_path),
        gpu_memory_gib=80,
        gradient_checkpointing=True,
        micro_batch_tokens=8192,
    )
    check_fits(settings, 8, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):  # the same on one rank does not
        check_fits(settings, 1, torch.device("cpu"))


def test_check_fits_on_cpu_without_gpu_memory_checks_nothing() -> None:
    settings = TrainerSection(model=Path("no/such/model"))
    check_fits(settings, 1, torch.device("cpu"))  # would raise if it built the model


def test_policy_load_refuses_a_configuration_that_cannot_fit() -> None:
    settings = TrainerSection(model=TINY, device="cpu", gpu_memory_gib=0.5)
    with pytest.raises(ValueError, match=r"does not fit.*0\.50 GiB"):
        Policy.load(settings)


def _weight_copy(tensor: torch.Tensor) -> bool:
    """An autocast cast of a parameter (a leaf's bf16 copy, or its transpose)."""
    fn = tensor.grad_fn
    for _ in range(3):
        inputs = [f for f, _ in fn.next_functions if f is not None] if fn is not None else []
        if len(inputs) != 1:
            return False
        if type(inputs[0]).__name__ == "AccumulateGrad":
            return True
        fn = inputs[0]
    return False


def _saved_bytes(model: torch.nn.Module, vocab: int, rows: int, length: int, autocast: bool) -> int:
    """Bytes autograd saves in the forward of `rows` padded rows (parameters excluded)."""
    input_ids = torch.randint(0, vocab, (rows, length))
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    attention_mask[0, -5:] = 0  # padding: transformers builds a mask, as for packed rows
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and not _weight_copy(tensor):
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        model(input_ids=input_ids, attention_mask=attention_mask)
    return sum(saved.values())


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("source", ["tiny", "qwen3"])
def test_activation_estimate_matches_what_autograd_saves(source: str, autocast: bool) -> None:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY) if source == "tiny" else small_qwen3()
    model = AutoModelForCausalLM.from_config(config)
    rows, length = 2, 128
    settings = TrainerSection(
        micro_batch_tokens=rows * length, dtype="bfloat16" if autocast else "float32"
    )
    result = plan(config, settings, 1, None, device_type="cpu")
    measured = _saved_bytes(model, config.vocab_size, rows, length, autocast=autocast)
    # The loss's tensors over the logits are the loss code's, not the model's: left out.
    assert result.activations_full - result.logits == pytest.approx(measured, rel=0.05)


def test_cli_prints_the_plan_as_one_json_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HARNESSRL_CONFIG", raising=False)
    argv = ["trainer", "plan", "--model", str(TINY), "--gpus", "2", "--gpu-memory", "80"]
    assert main([*argv, "--lora-rank", "4", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert data["world_size"] == 2 and data["sharded"] is True
    assert data["lora_rank"] == 4
    assert data["fits"] is True and data["gpu_memory"] == 80 * GiB
    assert data["shape"]["total_params"] == 1_050_752


def test_cli_prints_a_table_with_the_verdict(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HARNESSRL_CONFIG", raising=False)
    assert main(["trainer", "plan", "--model", str(TINY), "--gpus", "1", "--gpu-memory", "1"]) == 0
    out = capsys.readouterr().out
    assert "1,050,752 total" in out
    assert "total (peak)" in out and "fits        NO" in out  # 1 GiB is all headroom


def test_trainer_help_still_shows_the_service_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["trainer", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--checkpoint-dir", "--max-steps", "--config", "--bootstrap", "plan"):
        assert flag in out


def test_trainer_flags_without_a_sub_command_still_run_the_service() -> None:
    parser = build_parser()
    service = parser.parse_args(["trainer", "--model", "m", "--max-steps", "3"])
    assert service.run is trainer_cli.run and service.model == "m" and service.max_steps == 3
    planned = parser.parse_args(["trainer", "plan", "--model", "m", "--gpus", "2"])
    assert planned.run is trainer_cli.plan and planned.gpus == 2
