"""builtin:answer — the harness's final answer against the task's expected answer.

The answer comes from the harness's result (its `answer_key`, or the result itself when it
is a bare string or number); the expected answer from the task metadata, which the harness
never sees. Matching is exact, numeric within tolerance, or on normalised text.
"""

from __future__ import annotations

import math
import re
import string
from typing import Any

from harnessrl.services.reward.config import AnswerSettings
from harnessrl.services.reward.episode import Episode, Score

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_IN_TEXT = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:e[-+]?\d+)?%?", re.IGNORECASE)
_NUMBER = re.compile(r"^[-+]?(\d[\d,_]*\.?\d*|\.\d+)(e[-+]?\d+)?%?$", re.IGNORECASE)


class AnswerReward:
    """builtin:answer: 1.0 when the answer matches, else 0.0 (component "correct")."""

    def __init__(self, settings: AnswerSettings) -> None:
        self._settings = settings

    def __call__(self, episode: Episode) -> Score:
        settings = self._settings
        metadata = episode.task_metadata
        if settings.expected_key not in metadata:
            raise ValueError(f"task metadata.{settings.expected_key}: required by builtin:answer")
        expected = metadata[settings.expected_key]
        match = metadata.get("match", settings.match)
        if match not in ("auto", "exact", "numeric", "text"):
            raise ValueError(f"task metadata.match: {match!r} is not auto|exact|numeric|text")
        answer = _answer(episode.result, settings.answer_key)
        if answer is None:
            return Score(0.0, {"correct": 0.0}, ("no_answer",), "the result holds no answer")
        correct = matches(answer, expected, match, settings.rel_tol, settings.abs_tol)
        return Score(float(correct), {"correct": float(correct)})


def _answer(result: Any, key: str) -> str | int | float | None:
    if isinstance(result, dict):
        result = result.get(key)
    if isinstance(result, bool) or not isinstance(result, str | int | float):
        return None
    return result


def matches(answer: Any, expected: Any, how: str, rel_tol: float, abs_tol: float) -> bool:
    """Whether `answer` matches `expected` by `how` (auto | exact | numeric | text)."""
    if how == "exact":
        return str(answer) == str(expected)
    left, right = number(answer), number(expected)
    if how == "auto" and left is None and right is not None:
        left = last_number(str(answer))  # "The answer is 42." states 42
    if how == "numeric" or (how == "auto" and left is not None and right is not None):
        if left is None or right is None:
            return False
        return math.isclose(left, right, rel_tol=rel_tol, abs_tol=abs_tol)
    return normalise(str(answer)) == normalise(str(expected))


def number(value: Any) -> float | None:
    """The number a value states ("1,234.5", "42%", 3), or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value) if math.isfinite(value) else None
    text = str(value).strip().rstrip(".").replace(" ", "")
    if not _NUMBER.match(text):
        return None
    percent = text.endswith("%")
    parsed = float(text.rstrip("%").replace(",", "").replace("_", ""))
    return parsed / 100 if percent else parsed


def last_number(text: str) -> float | None:
    """The last number written in free text, or None."""
    found = _IN_TEXT.findall(text)
    return number(found[-1]) if found else None


def normalise(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())
