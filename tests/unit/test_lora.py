"""LoRA in the trainer (services/trainer/lora.py) and on the wire (harnessrl.weights.adapter):
names, config, the first pass, what trains, what is published, PEFT directories, manifests,
and the engine's in-process application of an adapter (services/inference/lora_hooks.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from harnessrl.services.inference.lora_hooks import LoraOverlay
from harnessrl.services.trainer.config import LoraSection, TrainerSection
from harnessrl.services.trainer.distributed import World
from harnessrl.services.trainer.lora import (
    adapter_config,
    adapter_spec,
    published_name,
    read_adapter_dir,
    write_adapter_dir,
)
from harnessrl.services.trainer.policy import Policy
from harnessrl.trust.packing import SampleArrays
from harnessrl.v1 import weights_pb2 as pb
from harnessrl.weights import WeightSyncError, build_manifest, verify_manifest
from harnessrl.weights.adapter import base_checksum, check_base
from harnessrl.weights.manifest import spec_for

VOCAB = 96
LORA = LoraSection(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Qwen2 saved as a model directory (what trainer.model names)."""
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    directory = tmp_path_factory.mktemp("base")
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def _policy(base_dir: Path, lora: LoraSection | None = LORA) -> Policy:
    settings = TrainerSection(model=base_dir, device="cpu", dtype="float32", lora=lora, lr=1e-2)
    return Policy.load(settings, World())


def _base(base_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(seed))


def _logp(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), dim=-1)


def _perturb(policy: Policy, scale: float = 0.05) -> None:
    """Adapters as training would leave them: B no longer zero."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in policy.model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def test_published_names_are_peft_file_names_of_the_adapter_pairs_only() -> None:
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert published_name(key) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert published_name(key.replace("lora_A", "lora_B")) == (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    )
    for frozen in (
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias",
        "base_model.model.model.embed_tokens.weight",
        "base_model.model.lm_head.weight",
    ):
        assert published_name(frozen) is None


def test_a_lora_policy_publishes_only_float32_adapters_and_trains_only_them(
    base_dir: Path,
) -> None:
    policy = _policy(base_dir)
    state = policy.state_dict()
    modules = [f"model.layers.{i}.{m}" for i in range(2) for m in _modules(LORA)]
    assert sorted(state) == sorted(
        f"base_model.model.{m}.lora_{x}.weight" for m in modules for x in "AB"
    )
    assert {t.dtype for t in state.values()} == {torch.float32}
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert state[f"{q}.lora_A.weight"].shape == (4, 32)
    assert state[f"{q}.lora_B.weight"].shape == (32, 4)
    assert all(not t.any() for n, t in state.items() if ".lora_B." in n)  # B starts at zero
    trainable = [p for p in policy.model.parameters() if p.requires_grad]
    optimised = [p for group in policy.optimizer.param_groups for p in group["params"]]
    assert len(trainable) == len(optimised) == len(state)
    assert {p.data_ptr() for p in optimised} == {t.data_ptr() for t in state.values()}


def _modules(lora: LoraSection) -> list[str]:
    where = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn"}
    return [f"{where.get(m, 'mlp')}.{m}" for m in lora.target_modules]


def test_the_first_pass_gives_the_base_models_log_probs_exactly(base_dir: Path) -> None:
    ids = _ids()
    policy = _policy(base_dir)
    policy.model.eval()
    assert torch.equal(_logp(policy.model, ids), _logp(_base(base_dir), ids))


def test_a_step_moves_the_adapters_leaves_the_base_and_starts_without_mismatch(
    base_dir: Path,
) -> None:
    policy = _policy(base_dir)
    base = _base(base_dir)
    ids = _ids(seed=3)
    samples = []
    for row in range(ids.shape[0]):
        tokens = ids[row].numpy()
        logp = _logp(base, ids[row : row + 1])[0, :-1].gather(-1, ids[row, 1:, None])[:, 0]
        mask = np.zeros(tokens.size, dtype=np.bool_)
        mask[5:] = True
        samples.append(
            SampleArrays(
                sample_id=f"s{row}",
                episode_id=f"e{row}",
                token_ids=tokens.astype(np.int64),
                loss_mask=mask,
                behavior=np.where(mask, np.r_[0.0, logp.numpy()], 0.0).astype(np.float32),
                advantage=1.0 if row % 2 else -1.0,
                temperature=1.0,
                policy_version_min=0,
            )
        )
    frozen = {
        k: v.clone() for k, v in policy.model.state_dict().items() if published_name(k) is None
    }
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    stats = policy.step(samples)
    assert stats.mismatch < 1e-6  # the engine's log-probs (the base's) are the trainer's
    after = policy.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    moved = [k for k, v in policy.state_dict().items() if not torch.equal(v, before[k])]
    assert moved and all(".lora_" in k for k in moved)


def test_the_adapter_config_is_peft_lora_config(base_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig

    config = adapter_config(LORA, base_dir)
    assert config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(base_dir)
    assert not config["modules_to_save"] and not config["use_dora"]  # vLLM refuses both
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    loaded = LoraConfig.from_pretrained(tmp_path)
    assert (loaded.r, loaded.lora_alpha, loaded.peft_type.value) == (4, 8, "LORA")


def test_a_written_adapter_dir_loads_with_peft_and_gives_the_trainers_log_probs(
    base_dir: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    policy = _policy(base_dir)
    _perturb(policy)
    policy.model.eval()
    directory = write_adapter_dir(tmp_path / "adapter", policy.model, LORA, base_dir)
    assert sorted(p.name for p in directory.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    ids = _ids(seed=5)
    reloaded = PeftModel.from_pretrained(_base(base_dir), directory).eval()
    assert torch.equal(_logp(reloaded, ids), _logp(policy.model, ids))
    assert (_logp(reloaded, ids) - _logp(_base(base_dir), ids)).abs().max() > 1e-3

    fresh = _policy(base_dir)  # B zero: the base
    read_adapter_dir(directory, fresh.model)
    fresh.model.eval()
    assert torch.equal(_logp(fresh.model, ids), _logp(policy.model, ids))


def test_reading_an_adapter_dir_of_another_shape_changes_nothing(
    base_dir: Path, tmp_path: Path
) -> None:
    other = _policy(base_dir, LoraSection(rank=2, target_modules=("q_proj",)))
    directory = write_adapter_dir(tmp_path / "other", other.model, LORA, base_dir)
    policy = _policy(base_dir)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    with pytest.raises(ValueError, match="do not fit the model"):
        read_adapter_dir(directory, policy.model)
    assert all(torch.equal(v, before[k]) for k, v in policy.state_dict().items())


def test_the_manifest_checksum_covers_the_adapter_description(base_dir: Path) -> None:
    state = _policy(base_dir).state_dict()
    spec = adapter_spec(LORA, base_dir)
    assert spec.base_checksum == base_checksum(base_dir)
    assert spec.base_checksum.startswith("xxh3_64:")
    specs = [spec_for(n, t, "xxh3_64:0") for n, t in state.items()]
    manifest = build_manifest(1, 1, specs, adapter=spec)
    verify_manifest(manifest)
    full = build_manifest(1, 1, specs)
    assert full.manifest_checksum != manifest.manifest_checksum
    assert not full.HasField("adapter")
    for change in ("rank", "alpha", "base"):
        altered = pb.WeightManifest()
        altered.CopyFrom(manifest)
        if change == "rank":
            altered.adapter.rank = 8
        elif change == "alpha":
            altered.adapter.alpha = 16.0
        else:
            altered.adapter.base_checksum = "xxh3_64:0"
        with pytest.raises(WeightSyncError, match="manifest checksum mismatch"):
            verify_manifest(altered)
    misnamed = build_manifest(
        1, 1, [spec_for("model.norm.weight", torch.ones(2), "crc32:0")], adapter=spec
    )
    with pytest.raises(WeightSyncError, match="not a LoRA pair name"):
        verify_manifest(misnamed)


def test_an_adapter_for_another_base_is_refused_naming_both(base_dir: Path) -> None:
    spec = adapter_spec(LORA, base_dir)
    check_base(spec, base_checksum(base_dir), "version 3")
    check_base(spec, "", "version 3")  # an engine that cannot read its base: not compared
    with pytest.raises(WeightSyncError, match=r"version 3: the adapter is for base model"):
        check_base(spec, "xxh3_64:1234", "version 3")


def test_the_engines_overlay_gives_the_trainers_log_probs_and_detaches_to_the_base(
    base_dir: Path,
) -> None:
    policy = _policy(base_dir)
    _perturb(policy)
    policy.model.eval()
    ids = _ids(seed=7)
    engine_model = _base(base_dir)
    base_logp = _logp(engine_model, ids)
    overlay = LoraOverlay.build(
        engine_model,
        adapter_spec(LORA, base_dir),
        {k: v.clone() for k, v in policy.state_dict().items()},
    )
    overlay.attach(engine_model)
    assert (_logp(engine_model, ids) - _logp(policy.model, ids)).abs().max() <= 1e-5
    overlay.detach()
    assert torch.equal(_logp(engine_model, ids), base_logp)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        ("drop_b", "has lora_A only"),
        ("shape", r"expected \(4, 32\) / \(32, 4\)"),
        ("untargeted", "not one of the target modules"),
        ("missing", "missing in the model"),
    ],
)
def test_an_overlay_that_does_not_fit_the_model_is_refused(
    base_dir: Path, edit: str, error: str
) -> None:
    state = dict(_policy(base_dir).state_dict())
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    if edit == "drop_b":
        del state[f"{q}.lora_B.weight"]
    elif edit == "shape":
        state[f"{q}.lora_A.weight"] = torch.zeros(4, 31)
    elif edit == "untargeted":
        k = "base_model.model.model.layers.0.self_attn.k_proj"
        state[f"{k}.lora_A.weight"] = torch.zeros(4, 32)
        state[f"{k}.lora_B.weight"] = torch.zeros(16, 4)
    else:
        state["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 32)
    with pytest.raises(ValueError, match=error):
        LoraOverlay.build(_base(base_dir), adapter_spec(LORA, base_dir), state)
