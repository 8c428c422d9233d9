"""`swe synth`'s candidate bugs: a seeded sample of the mutations of a project's code (never
its tests), each with a stable key, in a seeded order."""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from harnessrl.apps.swe.mutate import Mutation, mutations
from harnessrl.apps.swe.projects import Project
from harnessrl.apps.swe.swebench import is_test_path


@dataclass(frozen=True, slots=True)
class Candidate:
    key: str
    """Stable id: a digest of the project, the seed and the mutation."""
    mutation: Mutation


def code_files(project: Project, repo: Path) -> list[str]:
    """The project's code modules (repository-relative, sorted): never test code."""
    root = repo / project.code
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    out = []
    for path in files:
        relative = path.relative_to(repo).as_posix()
        if not is_test_path(relative) and "/." not in f"/{relative}":
            out.append(relative)
    return out


def sample(project: Project, repo: Path, seed: int, most: int) -> tuple[list[Candidate], int]:
    """A seeded sample of the project's mutations (at most `most`), in the seeded order,
    and how many there were."""
    heap: list[tuple[str, int, Candidate]] = []  # max-heap by key: (negated key, n, cand)
    count = 0
    for path in code_files(project, repo):
        try:
            source = (repo / path).read_bytes().decode("utf-8")  # newlines as they are
            for candidate in _keyed(project, seed, path, source):
                count += 1
                item = (_negated(candidate.key), count, candidate)
                if len(heap) < most:
                    heapq.heappush(heap, item)
                elif item[0] > heap[0][0]:
                    heapq.heapreplace(heap, item)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # not Python 3 source: no candidates from it
    ordered = sorted((c for _, _, c in heap), key=lambda c: c.key)
    return ordered, count


def _keyed(project: Project, seed: int, path: str, source: str) -> Iterator[Candidate]:
    seen: Counter[tuple[int, str]] = Counter()
    for mutation in mutations(path, source):
        what = f"{project.requirement}\0{seed}\0{path}\0{mutation.line}\0{mutation.description}"
        # two edits of one line can read alike (`1` -> `2` twice): the later ones numbered
        nth = seen[mutation.line, mutation.description]
        seen[mutation.line, mutation.description] += 1
        key = hashlib.sha256(f"{what}\0{nth}".encode() if nth else what.encode()).hexdigest()
        yield Candidate(key[:16], mutation)


def _negated(key: str) -> str:
    """A string that sorts in the reverse order of the hex `key` (for a max-heap)."""
    return "".join("0123456789abcdef"[15 - int(c, 16)] for c in key)
