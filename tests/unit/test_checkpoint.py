"""Trainer checkpoints: a full round trip on the real tiny model, atomic saves under
failures and SIGKILL, pruning, and strict loading."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from harnessrl.services.trainer import checkpoint, tensors
from harnessrl.services.trainer.checkpoint import Checkpoints, TrainerState
from harnessrl.services.trainer.delivery import LedgerState

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
INPUT = torch.tensor([[5, 17, 42, 99, 7, 300]])

# Saves checkpoints of a Linear model in a loop, resuming from the latest one the way the
# trainer does; the weights and the delivery state are functions of the step, so a reader
# can tell a torn checkpoint from a whole one. "die-at-rename" SIGKILLs itself at the
# rename of its second save: a crash with the temporary directory fully written.
SAVER = """
import os, signal, sys
from pathlib import Path
import torch
from harnessrl.services.trainer import tensors
from harnessrl.services.trainer.checkpoint import Checkpoints, TrainerState
from harnessrl.services.trainer.delivery import LedgerState

ckpts = Checkpoints(Path(sys.argv[1]), keep=2)
ckpts.cleanup_partial()
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
latest = ckpts.latest()
step = ckpts.load(latest, tensors.reader(model, optimizer)).step if latest else 0
while True:
    step += 1
    with torch.no_grad():
        model.weight.fill_(step)
        model.bias.fill_(-step)
    trained = {f"ep-{i}/0/0": i for i in range(step * 3)}
    state = TrainerState(step, step, LedgerState(trained, horizon=step), {"run": "crash"})
    ckpts.save(tensors.writer(model, optimizer), state)
    print(step, flush=True)
    if sys.argv[2] == "die-at-rename":
        os.rename = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
"""


def _start_saver(root: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SAVER, str(root), mode], stdout=subprocess.PIPE, text=True
    )


def _first_save(proc: subprocess.Popen[str]) -> None:
    """Returns once the saver has reported its first save."""
    assert proc.stdout is not None
    if not proc.stdout.readline():
        proc.kill()
        proc.wait()
        pytest.fail("the saver died before its first save")


def _reap(proc: subprocess.Popen[str]) -> int:
    """Waits for a saver to die (killing it if it outlives the wait); returns how many saves
    it reported."""
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return 1 + len(out.split())


def _linear_state(step: int) -> TrainerState:
    return TrainerState(step, step, LedgerState({f"s{step}": step}))


def _save_linear(ckpts: Checkpoints, step: int) -> Path:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return ckpts.save(tensors.writer(model, optimizer), _linear_state(step))


def _trained_tiny() -> tuple[PreTrainedModel, torch.optim.AdamW, LambdaLR]:
    """The tiny model after one real AdamW step (so exp_avg and exp_avg_sq are non-zero)."""
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    model(input_ids=INPUT, labels=INPUT).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return model, optimizer, scheduler


def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(4)


def test_round_trip_restores_weights_optimizer_state_rng_and_delivery_state(
    tmp_path: Path,
) -> None:
    model, optimizer, scheduler = _trained_tiny()
    state = TrainerState(
        step=1,
        policy_version=7,
        ledger=LedgerState({"ep-1/0/0": 5, "ep-2/1/3": 7, "odd\rid": 6, "tab\tid": 5, "": 7}, 5),
        extra={"config_hash": "abc123", "tokens_seen": 6},
    )
    ckpts = Checkpoints(tmp_path / "ckpt")
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    path = ckpts.save(
        tensors.writer(model, optimizer, scheduler),
        state,
        tokenizer=AutoTokenizer.from_pretrained(TINY),
    )
    after_save = _draws()

    fresh = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_scheduler = LambdaLR(fresh_optimizer, lambda step: 1.0 / (step + 1))
    assert not torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    random.seed(10)
    np.random.seed(20)
    torch.manual_seed(30)

    loaded = ckpts.load(path, tensors.reader(fresh, fresh_optimizer, fresh_scheduler))

    assert ckpts.latest() == path
    assert loaded == state
    after_load = _draws()
    assert after_load[:2] == after_save[:2]
    assert torch.equal(after_load[2], after_save[2])
    original = model.state_dict()
    restored = fresh.state_dict()
    assert original.keys() == restored.keys()
    for key, tensor in original.items():
        assert torch.equal(tensor, restored[key]), key
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight  # still tied
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][name], fresh_optimizer.state[q][name]), name
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert fresh_scheduler.last_epoch == scheduler.last_epoch == 1

    model.eval()
    reloaded = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=INPUT).logits, model(input_ids=INPUT).logits)
    assert (
        AutoTokenizer.from_pretrained(path)("hello world")["input_ids"]
        == (AutoTokenizer.from_pretrained(TINY)("hello world")["input_ids"])
    )


def test_round_trip_of_a_plain_module_with_tied_weights(tmp_path: Path) -> None:
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model, fresh = Tied(), Tied()
    ckpts = Checkpoints(tmp_path)
    path = ckpts.save(tensors.writer(model, torch.optim.SGD(model.parameters())), _linear_state(3))

    ckpts.load(path, tensors.reader(fresh, torch.optim.SGD(fresh.parameters())), restore_rng=False)

    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.head.weight is fresh.embed.weight


@pytest.mark.parametrize("failing", ["rename", "fsync"])
def test_failed_save_leaves_previous_checkpoint_latest_and_no_debris(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    ckpts = Checkpoints(tmp_path)
    first = _save_linear(ckpts, 1)

    def fail(*args: object) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(checkpoint.os, failing, fail)
    with pytest.raises(OSError, match="disk on fire"):
        _save_linear(ckpts, 2)
    monkeypatch.undo()

    assert ckpts.latest() == first
    assert [p.name for p in tmp_path.iterdir()] == [first.name]
    model = torch.nn.Linear(4, 4)
    assert ckpts.load(first, tensors.reader(model, torch.optim.SGD(model.parameters()))).step == 1


def test_crash_at_rename_keeps_previous_latest_and_cleanup_removes_temp_dir(
    tmp_path: Path,
) -> None:
    saver = _start_saver(tmp_path, "die-at-rename")
    _first_save(saver)
    saves = _reap(saver)

    ckpts = Checkpoints(tmp_path)
    assert saves == 1
    latest = ckpts.latest()
    assert latest is not None and latest.name == "step-00000001"
    debris = [p for p in tmp_path.iterdir() if not p.name.startswith("step-")]
    assert len(debris) == 1 and debris[0].is_dir()

    ckpts.cleanup_partial()
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]


def test_sigkill_at_random_moments_always_leaves_a_loadable_latest(tmp_path: Path) -> None:
    """Two savers on two roots (in parallel: torch takes seconds to import), each
    SIGKILLed at a random moment, then restarted from its latest checkpoint and killed
    again."""
    delays = random.Random(0)
    roots = [tmp_path / f"run-{i}" for i in range(2)]
    previous_step = dict.fromkeys(roots, 0)
    for _ in range(2):
        procs = {root: _start_saver(root, "loop") for root in roots}
        for proc in procs.values():
            _first_save(proc)
        started = time.monotonic()
        for delay, root in sorted((delays.uniform(0.0, 0.3), root) for root in roots):
            time.sleep(max(0.0, started + delay - time.monotonic()))
            procs[root].send_signal(signal.SIGKILL)
        for root, proc in procs.items():
            _reap(proc)
            previous_step[root] = _check_resumable(root, previous_step[root])


def _check_resumable(root: Path, previous_step: int) -> int:
    ckpts = Checkpoints(root, keep=2)
    latest = ckpts.latest()
    assert latest is not None
    model = torch.nn.Linear(64, 64)
    state = ckpts.load(latest, tensors.reader(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    assert state.step > previous_step  # resumed from the last run's checkpoint, then saved
    assert torch.all(model.weight == state.step) and torch.all(model.bias == -state.step)
    trained = {f"ep-{i}/0/0": i for i in range(state.step * 3)}
    assert state.ledger == LedgerState(trained, horizon=state.step)
    ckpts.cleanup_partial()
    assert all(p.name.startswith("step-") for p in root.iterdir())
    return state.step


def test_latest_ignores_a_step_dir_without_complete_marker(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path)
    first = _save_linear(ckpts, 1)
    torn = tmp_path / "step-00000005"
    shutil.copytree(first, torn)
    (torn / checkpoint.COMPLETE).unlink()

    assert ckpts.latest() == first
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        ckpts.load(torn, tensors.reader(model, torch.optim.SGD(model.parameters())))


def test_pruning_keeps_the_newest_checkpoints(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path, keep=2)
    for step in (1, 2, 3, 10):
        _save_linear(ckpts, step)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000010"]
    assert ckpts.latest() == tmp_path / "step-00000010"


def test_save_refuses_an_existing_step(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path)
    _save_linear(ckpts, 4)
    with pytest.raises(FileExistsError, match="step 4"):
        _save_linear(ckpts, 4)


@pytest.mark.parametrize(
    ("state", "field"),
    [
        (TrainerState(1, 1, LedgerState({"a\nb": 0})), "ledger.trained"),
        (TrainerState(1, 1, LedgerState({}), {"x": object()}), "extra"),
        (TrainerState(1, 1, LedgerState({}), {"x": float("nan")}), "extra"),
        (TrainerState(-1, 1, LedgerState({})), "step"),
    ],
)
def test_save_rejects_an_unstorable_state_before_writing(
    tmp_path: Path, state: TrainerState, field: str
) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=field):
        Checkpoints(tmp_path / "ckpt").save(
            tensors.writer(model, torch.optim.SGD(model.parameters())), state
        )
    assert not (tmp_path / "ckpt").exists()


def test_load_is_strict_about_weights_and_scheduler(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path)
    path = _save_linear(ckpts, 1)
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(RuntimeError, match="does not match the model"):
        ckpts.load(path, tensors.reader(other, torch.optim.SGD(other.parameters())))

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no scheduler state"):
        ckpts.load(path, tensors.reader(model, optimizer, LambdaLR(optimizer, lambda step: 1.0)))


def test_cleanup_partial_without_root_is_a_no_op(tmp_path: Path) -> None:
    ckpts = Checkpoints(tmp_path / "missing")
    ckpts.cleanup_partial()
    assert ckpts.latest() is None
    assert not (tmp_path / "missing").exists()
    assert os.listdir(tmp_path) == []
