"""Trainer checkpoints: weights, optimizer, RNG and delivery state, written atomically.

One checkpoint is the directory `root/step-<step:08d>/`:

    dcp/, scheduler.pt
                    model and optimizer state, sharded per rank (torch.distributed.checkpoint;
                    resumable at any world size), and the LR scheduler (tensors.py)
    model*.safetensors (+ config.json, generation_config.json, tokenizer files)
                    the exported model: the directory loads with `from_pretrained`, so the
                    trainer and the inference engines (vLLM too) can start from it
    rng.pt          python `random`, numpy, torch CPU and CUDA generator states
    state.json      step, policy version, the ledger's horizon, extra, sample count
    samples.txt     the trained samples the ledger remembers, one per line (UTF-8):
                    "<policy_version_min>\t<sample id>"; bounded by max_staleness, not
                    by the samples ever trained (ledger.py)
    COMPLETE        written last

Atomicity: everything is written into a temporary directory in `root` (same filesystem),
every file and the directory are fsynced, the directory is renamed to its final name and
`root` is fsynced. A crash at any point leaves the previous checkpoints untouched and either
no new one or a complete one; `latest()` never picks a half-written directory (temporary
names never match, and a step directory without COMPLETE is ignored). One writer per root.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harnessrl.logs import get_logger
from harnessrl.services.trainer.delivery import LedgerState

log = get_logger(__name__)

COMPLETE = "COMPLETE"
STATE = "state.json"
SAMPLES = "samples.txt"
RNG = "rng.pt"
FORMAT = 3  # bump when the layout changes; load() refuses formats it does not know

_STEP_DIR = re.compile(r"step-(\d{8,})")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What the trainer needs, besides tensors, to resume without training anything twice."""

    step: int  # optimizer steps taken
    policy_version: int  # version of the weights in this checkpoint
    ledger: LedgerState  # the trained samples a re-delivery could still bring back
    extra: Mapping[str, Any] = field(default_factory=dict)  # JSON-able (config hash, ...)


class Checkpoints:
    """The checkpoints under one root directory, newest `keep` kept."""

    def __init__(self, root: Path, *, keep: int = 3) -> None:
        """Raises ValueError if `keep` < 1. Touches nothing on disk."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep

    def save(
        self,
        write: Callable[[Path], None],
        state: TrainerState,
        *,
        tokenizer: Any | None = None,
        replace: bool = False,
    ) -> Path:
        """Writes checkpoint `root/step-<state.step:08d>` atomically, then prunes to the
        newest `keep` complete checkpoints; returns the checkpoint's path.

        `write(directory)` puts the tensors into the (temporary) directory: the training
        state and the exported model (tensors.save, through Policy.save_tensors on every
        rank); with `tokenizer`'s files the directory is a loadable model directory.
        Raises ValueError for a state that cannot be stored (negative step, a sample id
        with a newline, non-JSON `extra`) before writing anything; FileExistsError if a
        checkpoint for this step exists, unless `replace` (a rewind changes the weights
        without a step): the old one is then moved aside and removed once the new one is in
        place (a crash in between leaves the step without a checkpoint, never a mix; the
        trainer's start detects weights a rollback retired); OSError from the filesystem.
        On any error the temporary directory is removed and no checkpoint is added.
        """
        started = time.monotonic()
        state_json = _encode_state(state)
        final = self.root / f"step-{state.step:08d}"
        self.root.mkdir(parents=True, exist_ok=True)
        if final.exists() and not replace:
            raise FileExistsError(f"a checkpoint for step {state.step} exists: {final}")
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=self.root))
        doomed: Path | None = None
        try:
            write(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            torch.save(_rng_state(), tmp / RNG)
            _write_samples(tmp / SAMPLES, state.ledger.trained)
            (tmp / STATE).write_text(state_json, encoding="utf-8")
            _fsync_tree(tmp)
            (tmp / COMPLETE).write_text(f"{state.step}\n", encoding="utf-8")
            _fsync_file(tmp / COMPLETE)
            _fsync_dir(tmp)
            if final.exists():
                doomed = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}replaced-", dir=self.root))
                os.rename(final, doomed / final.name)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # best effort; cleanup_partial() finishes
            raise
        _fsync_dir(self.root)
        if doomed is not None:
            shutil.rmtree(doomed)
        pruned = self._prune()
        log.info(
            "checkpoint saved",
            step=state.step,
            policy_version=state.policy_version,
            path=str(final),
            samples=len(state.ledger.trained),
            pruned=pruned,
            seconds=round(time.monotonic() - started, 3),
        )
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint (highest step with a COMPLETE marker), or None.
        Temporary directories and step directories without COMPLETE are ignored."""
        complete = self._complete()
        return complete[-1][1] if complete else None

    def load(
        self, path: Path, read: Callable[[Path], None], *, restore_rng: bool = True
    ) -> TrainerState:
        """Loads checkpoint `path`: `read(path)` restores the tensors (tensors.load, through
        Policy.load_tensors on every rank), the RNG states are restored if `restore_rng`,
        and the stored TrainerState is returned.

        Raises ValueError if `path` is not a complete checkpoint of a known format, or if
        its samples do not match the count in state.json; whatever `read` raises (a
        model that does not match the weights). After an error the model and optimizer
        may be partly loaded.
        """
        path = Path(path)
        if not (path / COMPLETE).is_file():
            raise ValueError(f"not a complete checkpoint (no {COMPLETE}): {path}")
        state = _read_state(path)
        read(path)
        if restore_rng:
            _restore_rng(torch.load(path / RNG, map_location="cpu", weights_only=True))
        log.info("checkpoint loaded", step=state.step, path=str(path))
        return state

    def cleanup_partial(self) -> None:
        """Removes the temporary directories a crashed save or prune left in root.
        Call at start, before any save; idempotent; a missing root is fine."""
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.name.startswith(_TMP_PREFIX) and entry.is_dir():
                shutil.rmtree(entry)
                log.info("removed partial checkpoint", path=str(entry))

    def _complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.fullmatch(entry.name)
            if match and (entry / COMPLETE).is_file():
                found.append((int(match.group(1)), entry))
        return sorted(found)

    def _prune(self) -> list[int]:
        """Removes all but the newest `keep` complete checkpoints. Each is first renamed to
        a temporary name, so a crash mid-removal leaves only what cleanup_partial removes."""
        old = self._complete()[: -self.keep]
        for _, path in old:
            doomed = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}prune-", dir=self.root))
            os.rename(path, doomed / path.name)
            shutil.rmtree(doomed)
        return [step for step, _ in old]


def _encode_state(state: TrainerState) -> str:
    if state.step < 0:
        raise ValueError(f"step must be non-negative, got {state.step}")
    for sample_id, version_min in state.ledger.trained.items():
        if "\n" in sample_id:
            raise ValueError(f"ledger.trained: sample id {sample_id!r} contains a newline")
        if not isinstance(version_min, int):
            raise ValueError(f"ledger.trained[{sample_id!r}]: must be an int, got {version_min!r}")
    document = {
        "format": FORMAT,
        "step": state.step,
        "policy_version": state.policy_version,
        "horizon": state.ledger.horizon,
        "extra": dict(state.extra),
        "sample_count": len(state.ledger.trained),
    }
    try:
        return json.dumps(document, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as err:  # an object json cannot encode, NaN, infinity
        raise ValueError(f"extra: not storable as JSON: {err}") from err


def _read_state(path: Path) -> TrainerState:
    document = json.loads((path / STATE).read_text(encoding="utf-8"))
    if document.get("format") != FORMAT:
        raise ValueError(f"{path / STATE}: unknown format {document.get('format')!r}")
    data = (path / SAMPLES).read_bytes().decode("utf-8")
    lines = data.split("\n")[:-1]  # each ends with "\n"; no splitlines(): ids may hold "\r"
    trained = {}
    for line in lines:
        version_min, sample_id = line.split("\t", 1)  # an id may hold tabs, the number none
        trained[sample_id] = int(version_min)
    if len(lines) != document["sample_count"] or len(trained) != len(lines):
        raise ValueError(
            f"{path / SAMPLES}: {len(lines)} samples ({len(trained)} distinct), "
            f"state.json says {document['sample_count']}"
        )
    return TrainerState(
        step=int(document["step"]),
        policy_version=int(document["policy_version"]),
        ledger=LedgerState(trained, horizon=int(document["horizon"])),
        extra=document["extra"],
    )


def _write_samples(path: Path, trained: Mapping[str, int]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{version_min}\t{sample_id}\n" for sample_id, version_min in trained.items())


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        # numpy's key is a uint32 array; as an int64 tensor it loads with weights_only.
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _restore_rng(saved: dict[str, Any]) -> None:
    random.setstate(saved["python"])
    numpy_state = saved["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {
                "key": numpy_state["key"].numpy().astype(np.uint32),
                "pos": numpy_state["pos"],
            },
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(saved["torch"])
    if saved["cuda"] and torch.cuda.is_available():
        # Restores as many devices as both the checkpoint and this process have.
        for device, cuda_state in enumerate(saved["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _fsync_tree(directory: Path) -> None:
    for dirpath, _, filenames in os.walk(directory, topdown=False):
        for name in filenames:
            _fsync_file(Path(dirpath) / name)
        _fsync_dir(Path(dirpath))


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
