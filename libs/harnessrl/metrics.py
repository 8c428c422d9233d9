"""Prometheus helpers shared by the services."""

from __future__ import annotations

from typing import Any


class Labelled:
    """A labelled metric whose children are looked up once per label values.

    `metric.labels(...)` validates and locks on every call; on a per-record path that shows
    up in profiles, so children are cached.
    """

    def __init__(self, metric: Any) -> None:
        self.metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child
