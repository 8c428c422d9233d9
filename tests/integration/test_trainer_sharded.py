"""The trainer's ranks under `torchrun` (gloo on CPU): an FSDP2 step, a LoRA step with
sharded adapters and a replicated step give the one-process update; a training state saved
by two sharded ranks resumes on one process and on two sharded ranks; the exported model
directory loads with `from_pretrained` and holds the trained weights, a LoRA one is a PEFT
adapter directory."""

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


def test_sharded_steps_and_a_sharded_checkpoint_resumed_on_one_or_two_ranks_match_one_process(
    tmp_path: Path,
) -> None:
    single, ranks = tmp_path / "single", tmp_path / "ranks"
    _run(2, ranks)
    _run(1, single, "--resume", str(ranks / "saved"))  # resumed on one process too
    for scenario, reference in [
        ("full-step-1", "full-step-1"),  # FSDP2
        ("replicate-step-1", "full-step-1"),
        ("lora-step-1", "lora-step-1"),  # sharded adapters on a frozen base
        ("full-step-2", "full-step-2"),
        ("resumed-step-2", "full-step-2"),  # saved by two ranks, resumed on two
    ]:
        diff = _max_diff(ranks / f"{scenario}.safetensors", single / f"{reference}.safetensors")
        assert diff <= 1e-5, scenario
    resumed_on_one = single / "resumed-step-2.safetensors"
    assert _max_diff(resumed_on_one, single / "full-step-2.safetensors") <= 1e-5
    base = load_file(TINY / "model.safetensors")
    trained = load_file(single / "full-step-1.safetensors")
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # the step moved weights
    # Each rank wrote its shards; the exported directory is the whole model.
    saved = ranks / "saved"
    assert sorted(p.name for p in (saved / "dcp").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    fsdp = load_file(ranks / "full-step-1.safetensors")
    assert all(torch.equal(exported[k], fsdp[k]) for k in fsdp)
    assert (ranks / "lora-saved" / "adapter_config.json").is_file()
    assert not (ranks / "lora-saved" / "model.safetensors").exists()
