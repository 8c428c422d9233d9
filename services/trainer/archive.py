"""Published versions kept on disk while a canary rollout needs them.

Under `production.canary`, engines must be able to pull the stable version and the pending
candidate whatever the trainer published since, also from a trainer that restarted, and
the trainer must be able to rewind its weights to the stable version after a rollback. So
each version that becomes stable or candidate is written, as published (its WeightSync
manifest and tensors, byte for byte), under `<checkpoint_dir>/versions/`:

    v<N>/weights.safetensors   the published tensors, under their published names
    v<N>/manifest.pb           its WeightManifest (version, step, checksums, adapter)

written into a temporary directory and renamed, so a crash leaves either the whole version
or none (`.tmp-*` leftovers are removed at start). A version is removed once the rollout no
longer needs it (see `VersionArchive.keep`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harnessrl.logs import get_logger
from harnessrl.v1 import weights_pb2 as weights_pb

log = get_logger(__name__)

WEIGHTS = "weights.safetensors"
MANIFEST = "manifest.pb"
_TMP_PREFIX = ".tmp-"


class VersionArchive:
    """The archived versions under `root` (one writer: the trainer's leader)."""

    def __init__(self, root: Path) -> None:
        """Touches nothing on disk."""
        self.root = Path(root)

    def path(self, version: int) -> Path:
        """Where version `version` is (or would be) archived."""
        return self.root / f"v{version}"

    def versions(self) -> list[int]:
        """The completely archived versions, ascending."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            name = entry.name
            if name.startswith("v") and name[1:].isdigit() and (entry / MANIFEST).is_file():
                found.append(int(name[1:]))
        return sorted(found)

    def save(
        self, manifest: weights_pb.WeightManifest, tensors: Mapping[str, torch.Tensor]
    ) -> Path:
        """Archive one published version atomically (idempotent: a version archived
        already is left as it is). Raises ValueError when `tensors` are not the manifest's."""
        final = self.path(manifest.version)
        if (final / MANIFEST).is_file():
            return final
        names = [spec.name for spec in manifest.tensors]
        if names != list(tensors):
            raise ValueError(
                f"version {manifest.version}: tensors {list(tensors)[:3]}... are not the "
                f"manifest's {names[:3]}..."
            )
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=self.root))
        try:
            save_file(dict(tensors), str(tmp / WEIGHTS), metadata={"format": "pt"})
            (tmp / MANIFEST).write_bytes(manifest.SerializeToString())
            for name in (WEIGHTS, MANIFEST):
                _fsync(tmp / name)
            _fsync(tmp)
            if final.exists():  # a directory without its manifest: a crash's leftover
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log.info("weights version archived", version=manifest.version, path=str(final))
        return final

    def load(self, version: int) -> tuple[weights_pb.WeightManifest, dict[str, torch.Tensor]]:
        """An archived version's manifest and tensors (in manifest order). Raises
        FileNotFoundError naming the version when it is not archived, ValueError when its
        files disagree (a tensor missing or extra)."""
        directory = self.path(version)
        if not (directory / MANIFEST).is_file():
            raise FileNotFoundError(
                f"weights version {version} is not archived in {self.root} (archived: "
                f"{self.versions()})"
            )
        manifest = weights_pb.WeightManifest.FromString((directory / MANIFEST).read_bytes())
        stored = load_file(str(directory / WEIGHTS))
        names = [spec.name for spec in manifest.tensors]
        if sorted(names) != sorted(stored):
            raise ValueError(
                f"{directory}: {WEIGHTS} holds {len(stored)} tensors, its manifest lists "
                f"{len(names)}: they differ"
            )
        return manifest, {name: stored[name] for name in names}

    def keep(self, versions: frozenset[int] | set[int]) -> list[int]:
        """Remove every archived version not in `versions`, and temporary leftovers;
        returns the versions removed."""
        if not self.root.is_dir():
            return []
        for entry in self.root.iterdir():
            if entry.name.startswith(_TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
        removed = [v for v in self.versions() if v not in versions]
        for version in removed:  # renamed first: a crash mid-removal leaves only a leftover
            doomed = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}removed-", dir=self.root))
            os.rename(self.path(version), doomed / "version")
            shutil.rmtree(doomed)
            log.info("archived weights version removed", version=version)
        return removed


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
