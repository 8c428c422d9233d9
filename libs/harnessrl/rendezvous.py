"""Rendezvous (highest-random-weight) hashing: which of several candidates a key goes to.

Every process that knows the same candidates agrees, with no state and no coordination; a
candidate added or removed moves only the keys that rank it first (1/N of them). The gateway
ranks its engines for an episode this way, the controller its gateway replicas.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def ranking(key: str, candidates: Sequence[str]) -> list[int]:
    """Indexes of `candidates`, best first, for `key`."""
    if len(candidates) == 1:
        return [0]
    scores = [
        hashlib.blake2b(f"{key}|{candidate}".encode(), digest_size=8).digest()
        for candidate in candidates
    ]
    return sorted(range(len(candidates)), key=lambda i: scores[i], reverse=True)
