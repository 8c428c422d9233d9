"""The calculator demo's reward: 1 when the harness's final answer states the right number.

Plugged in with `reward.source: entrypoint:examples.calculator.reward:score`. The expected
answer comes from the task metadata, which the harness never sees; the answer is the last
number in the harness's reply, so "The answer is 391." and "391" both count, and a reply
that names several numbers is judged by the one it ends on.
"""

from __future__ import annotations

import math
import re
from typing import Any

from harnessrl.services.reward.episode import Episode, Score

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def stated(reply: str) -> float | None:
    """The last number in `reply` ("1,234" reads as 1234), or None."""
    found = _NUMBER.findall(reply.replace(",", ""))
    return float(found[-1]) if found else None


def score(episode: Episode) -> Score:
    expected = float(episode.task_metadata["answer"])
    result: Any = episode.result if isinstance(episode.result, dict) else {}
    tools = float(result.get("tools", 0))
    reply = result.get("answer")
    if not isinstance(reply, str) or not reply.strip():
        return Score(0.0, {"correct": 0.0, "tool_calls": tools}, ("no_answer",))
    value = stated(reply)
    correct = value is not None and math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-6)
    return Score(float(correct), {"correct": float(correct), "tool_calls": tools})
