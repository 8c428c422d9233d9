"""Trainer checkpoints: weights, optimizer, RNG and delivery state, written atomically.

One checkpoint is the directory `root/step-<step:08d>/`:

    model.safetensors (+ config.json, generation_config.json, tokenizer files)
                    for a transformers model, the directory loads with `from_pretrained`,
                    so the trainer and the inference engines can start from it
    optimizer.pt    {"optimizer": state dict, "scheduler": state dict or None}
    rng.pt          python `random`, numpy, torch CPU and CUDA generator states
    state.json      step, policy version, consumed offsets, extra, sample id count
    samples.txt     the trained sample ids, one per line (UTF-8)
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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from safetensors.torch import load_file, save_model

from harnessrl.logs import get_logger

log = get_logger(__name__)

COMPLETE = "COMPLETE"
STATE = "state.json"
SAMPLES = "samples.txt"
OPTIMIZER = "optimizer.pt"
RNG = "rng.pt"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # written by save_pretrained when sharded
FORMAT = 1  # bump when the layout changes; load() refuses formats it does not know

_STEP_DIR = re.compile(r"step-(\d{8,})")
_TMP_PREFIX = ".tmp-"


@dataclass(frozen=True, slots=True)
class TrainerState:
    """What the trainer needs, besides tensors, to resume without training anything twice."""

    step: int  # optimizer steps taken
    policy_version: int  # version of the weights in this checkpoint
    trained_sample_ids: frozenset[str]  # every sample id trained on so far
    offsets: Mapping[str, int]  # consumed offsets: "topic:partition" -> next offset to read
    extra: Mapping[str, Any] = field(default_factory=dict)  # JSON-able (config hash, ...)


class Stateful(Protocol):
    """An LR scheduler, or anything else with a torch-style state dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


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
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Stateful | None,
        state: TrainerState,
        *,
        tokenizer: Any | None = None,
    ) -> Path:
        """Writes checkpoint `root/step-<state.step:08d>` atomically, then prunes to the
        newest `keep` complete checkpoints; returns the checkpoint's path.

        The model is saved with `save_pretrained` when it has one (with `tokenizer`'s files,
        if given, the directory is a loadable model directory), else as a safetensors file.
        Raises ValueError for a state that cannot be stored (negative step, a sample id
        with a newline, non-JSON `extra`) before writing anything; FileExistsError if a
        checkpoint for this step exists; OSError from the filesystem. On any error the
        temporary directory is removed and no checkpoint is added.
        """
        started = time.monotonic()
        state_json = _encode_state(state)
        final = self.root / f"step-{state.step:08d}"
        self.root.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise FileExistsError(f"a checkpoint for step {state.step} exists: {final}")
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=self.root))
        try:
            _save_model(model, tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            torch.save(
                {
                    "optimizer": optimizer.state_dict(),
                    "scheduler": None if scheduler is None else scheduler.state_dict(),
                },
                tmp / OPTIMIZER,
            )
            torch.save(_rng_state(), tmp / RNG)
            _write_ids(tmp / SAMPLES, state.trained_sample_ids)
            (tmp / STATE).write_text(state_json, encoding="utf-8")
            _fsync_tree(tmp)
            (tmp / COMPLETE).write_text(f"{state.step}\n", encoding="utf-8")
            _fsync_file(tmp / COMPLETE)
            _fsync_dir(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # best effort; cleanup_partial() finishes
            raise
        _fsync_dir(self.root)
        pruned = self._prune()
        log.info(
            "checkpoint saved",
            step=state.step,
            policy_version=state.policy_version,
            path=str(final),
            samples=len(state.trained_sample_ids),
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
        self,
        path: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Stateful | None = None,
        *,
        restore_rng: bool = True,
    ) -> TrainerState:
        """Loads checkpoint `path` into the existing model (strictly: every key matches;
        weights tied to a loaded one may be absent), optimizer and scheduler, restores the
        RNG states if `restore_rng`, and returns the stored TrainerState.

        Raises ValueError if `path` is not a complete checkpoint of a known format, if
        its sample ids do not match the count in state.json, or if `scheduler` is given
        but none was saved (a saved scheduler state with `scheduler=None` is ignored);
        RuntimeError if the weights do not match the model. After an error the model,
        optimizer and scheduler may be partly loaded.
        """
        path = Path(path)
        if not (path / COMPLETE).is_file():
            raise ValueError(f"not a complete checkpoint (no {COMPLETE}): {path}")
        state = _read_state(path)
        _load_model(model, path)
        # Optimizer and scheduler state dicts are plain tensors and containers, so
        # weights_only holds; the optimizer moves its state to its parameters' devices.
        saved = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=True)
        optimizer.load_state_dict(saved["optimizer"])
        if scheduler is not None:
            if saved["scheduler"] is None:
                raise ValueError(f"checkpoint {path} has no scheduler state to load")
            scheduler.load_state_dict(saved["scheduler"])
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
    if any("\n" in sample_id for sample_id in state.trained_sample_ids):
        raise ValueError("trained_sample_ids: a sample id contains a newline")
    for key, offset in state.offsets.items():
        if not isinstance(offset, int):
            raise ValueError(f"offsets[{key!r}]: must be an int, got {offset!r}")
    document = {
        "format": FORMAT,
        "step": state.step,
        "policy_version": state.policy_version,
        "offsets": dict(state.offsets),
        "extra": dict(state.extra),
        "sample_count": len(state.trained_sample_ids),
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
    ids = data.split("\n")[:-1]  # each id ends with "\n"; no splitlines(): ids may hold "\r"
    if len(ids) != document["sample_count"] or len(set(ids)) != len(ids):
        raise ValueError(
            f"{path / SAMPLES}: {len(ids)} ids ({len(set(ids))} distinct), "
            f"state.json says {document['sample_count']}"
        )
    return TrainerState(
        step=int(document["step"]),
        policy_version=int(document["policy_version"]),
        trained_sample_ids=frozenset(ids),
        offsets={str(k): int(v) for k, v in document["offsets"].items()},
        extra=document["extra"],
    )


def _write_ids(path: Path, ids: Iterable[str]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        f.writelines(f"{sample_id}\n" for sample_id in ids)


def _save_model(model: torch.nn.Module, directory: Path) -> None:
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        # transformers 5 always writes safetensors (its `safe_serialization` flag is gone;
        # passing it is silently swallowed by **kwargs), with config.json beside it.
        save_pretrained(directory)
    else:
        # save_model, not save_file(state_dict()): it drops aliases of shared tensors,
        # which save_file refuses.
        save_model(model, str(directory / WEIGHTS))


def _load_model(model: torch.nn.Module, directory: Path) -> None:
    index = directory / WEIGHTS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        files = [WEIGHTS]
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name in files:
        shard = load_file(directory / name)  # on CPU; load_state_dict copies to the params
        unexpected += model.load_state_dict(shard, strict=False).unexpected_keys
        loaded.update(shard)
    missing = _unaliased(model, loaded)
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {directory} does not match the model: "
            f"missing {missing[:10]} ({len(missing)}), "
            f"unexpected {sorted(unexpected)[:10]} ({len(unexpected)})"
        )


def _unaliased(model: torch.nn.Module, loaded: set[str]) -> list[str]:
    """The model's state keys that were not loaded and share no storage with a loaded key
    (tied weights, such as lm_head tied to the embeddings, are saved once)."""

    def where(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
        return (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))

    tensors = model.state_dict()
    filled = {where(tensors[k]) for k in loaded if k in tensors}
    return sorted(k for k, t in tensors.items() if k not in loaded and where(t) not in filled)


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
