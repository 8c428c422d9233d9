"""What a chain is made of: one recorded model call, the token arrays, and the decoder breaks
are told with; shared by the tree, the breaks and the merge."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

Decode = Callable[[Sequence[int]], str]
"""Token ids to text, special tokens included (used to classify breaks, never to train)."""

Ids = npt.NDArray[np.uint32]
Mask = npt.NDArray[np.bool_]
Logprobs = npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class Call:
    """One recorded model call of an episode (the fields of ModelCall that merging uses)."""

    seq: int
    """Position of the call within the episode attempt, assigned by the gateway."""
    prompt_ids: Ids
    """Prompt token ids exactly as the engine saw them, 1-D uint32."""
    completion_ids: Ids
    """Completion token ids exactly as the engine sampled them, 1-D uint32."""
    logprobs: Logprobs
    """Behaviour log-prob of each completion token; same length as completion_ids."""
    policy_version: int
    temperature: float
    span_id: str
    """Hex span id of the gateway's span for the call (trace link; the choices of one
    request share it)."""
    constrained: bool = False
    """Sampled under constrained decoding (ModelCall.constrained): its completion stays in
    its chain as context, never trained."""
    source: object = None
    """What the call was read from (opaque here: the builder's ModelCall)."""
