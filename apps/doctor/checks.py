"""Verdicts: a measured figure against the thresholds a check names."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"
_RANK = {NA: -1, OK: 0, WARN: 1, FAIL: 2}


@dataclass(frozen=True, slots=True)
class Check:
    id: str
    section: str
    title: str
    verdict: str
    value: str
    threshold: str
    detail: str = ""
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def at_most(value: float, ok: float, warn: float) -> str:
    """OK up to `ok`, WARN up to `warn`, FAIL above (a figure that should be low)."""
    return OK if value <= ok else WARN if value <= warn else FAIL


def at_least(value: float, ok: float, warn: float) -> str:
    """OK from `ok`, WARN from `warn`, FAIL below (a figure that should be high)."""
    return OK if value >= ok else WARN if value >= warn else FAIL


def worst(checks: list[Check]) -> str:
    """The worst verdict of `checks` (n/a counts for nothing; OK when there are none)."""
    return max((c.verdict for c in checks), key=_RANK.__getitem__, default=OK).replace(NA, OK)


def share(part: float, whole: float) -> float | None:
    return part / whole if whole else None


def stats(values: list[float]) -> dict[str, Any]:
    """n, mean, p50, p90, max, min of `values` (None each when there are none)."""
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "max": None, "min": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "mean": round(sum(ordered) / len(ordered), 4),
        "p50": at(0.5),
        "p90": at(0.9),
        "max": ordered[-1],
        "min": ordered[0],
    }
