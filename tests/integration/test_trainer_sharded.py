"""The trainer's ranks under `torchrun` (gloo on CPU): an FSDP2 step and a replicated
step give the one-process update, and a training state saved by two sharded ranks resumes
on one, one saved by one process resumes on two sharded ranks; the exported model
directory loads with `from_pretrained` and holds the trained weights; LoRA adapters shard
too and export as a PEFT adapter directory."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.model_helpers import TINY

pytestmark = pytest.mark.integration

WORKER = Path(__file__).resolve().parent / "workers" / "sharded_step.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _run(ranks: int, out: Path, *args: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    launcher = (
        [sys.executable]
        if ranks == 1
        else [str(TORCHRUN), "--nproc-per-node", str(ranks), "--master-port", str(_free_port())]
    )
    done = subprocess.run(
        [*launcher, str(WORKER), str(out), *args],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-4000:]
    assert f"world={ranks}" in done.stdout.decode()


def _max_diff(a: Path, b: Path) -> float:
    one, two = load_file(a), load_file(b)
    assert one.keys() == two.keys()
    return max(float((one[k] - two[k]).abs().max()) for k in one)


def test_sharded_steps_and_resumes_at_another_world_size_give_the_one_process_update(
    tmp_path: Path,
) -> None:
    _run(1, tmp_path / "single", "--steps", "2", "--save", str(tmp_path / "saved-by-one"))
    _run(2, tmp_path / "fsdp", "--save", str(tmp_path / "saved-by-two"))
    _run(2, tmp_path / "replicate", "--strategy", "replicate")
    single = tmp_path / "single" / "step-1.safetensors"
    assert _max_diff(tmp_path / "fsdp" / "step-1.safetensors", single) <= 1e-5
    assert _max_diff(tmp_path / "replicate" / "step-1.safetensors", single) <= 1e-5
    base = load_file(TINY / "model.safetensors")
    trained = load_file(single)
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the step moved weights
    # Two shards per tensor on disk; the exported directory is the whole model.
    assert sorted(p.name for p in (tmp_path / "saved-by-two" / "dcp").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "saved-by-two").state_dict()
    fsdp = load_file(tmp_path / "fsdp" / "step-1.safetensors")
    assert all(torch.equal(exported[k], fsdp[k]) for k in fsdp)
    # LoRA adapters on a frozen base, sharded: the same update; the export is the adapter.
    _run(1, tmp_path / "lora-single", "--lora")
    _run(2, tmp_path / "lora-fsdp", "--lora", "--save", str(tmp_path / "lora-saved"))
    lora_single = tmp_path / "lora-single" / "step-1.safetensors"
    assert _max_diff(tmp_path / "lora-fsdp" / "step-1.safetensors", lora_single) <= 1e-5
    assert (tmp_path / "lora-saved" / "adapter_config.json").is_file()
    assert not (tmp_path / "lora-saved" / "model.safetensors").exists()
    # Saved by two sharded ranks, resumed on one; saved by one process, resumed on two.
    resume = ["--first-batch", "1", "--resume"]
    _run(1, tmp_path / "on-one", *resume, str(tmp_path / "saved-by-two"))
    _run(2, tmp_path / "on-two", *resume, str(tmp_path / "saved-by-one"))
    two_steps = tmp_path / "single" / "step-2.safetensors"
    assert _max_diff(tmp_path / "on-one" / "step-2.safetensors", two_steps) <= 1e-5
    assert _max_diff(tmp_path / "on-two" / "step-2.safetensors", two_steps) <= 1e-5
