"""The one error a weight puller acts on: the bytes of a version failed verification."""

from __future__ import annotations


class WeightSyncError(Exception):
    """A version's manifest or bytes are not what the trainer published.

    Raised for a malformed manifest, a chunk naming an unknown tensor, a chunk out of range
    or overlapping bytes already received, missing bytes, and a checksum mismatch. The
    message names the tensor and what is wrong. Nothing is loaded when it is raised: the
    caller keeps serving its old weights (and may fetch again).
    """
