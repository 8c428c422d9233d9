"""Reading a service's Prometheus /metrics into the figures an experiment reports."""

from __future__ import annotations

from typing import Any

import httpx

_STEP_GAUGES = {
    "harnessrl_trainer_loss": "loss",
    "harnessrl_trainer_entropy": "entropy",
    "harnessrl_trainer_kl": "kl",
    "harnessrl_trainer_clip_fraction": "clip_fraction",
    "harnessrl_trainer_grad_norm": "grad_norm",
    "harnessrl_trainer_tokens_per_second": "tokens_per_second",
    "harnessrl_trainer_published_bytes": "published_bytes",
}


async def scrape(base_url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """GET `base_url`/metrics and `parse` it. Raises OSError when it cannot be read."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(f"{base_url}/metrics")
            response.raise_for_status()
    except httpx.HTTPError as err:
        raise OSError(f"{base_url}/metrics: {err!r}") from err
    return parse(response.text)


def parse(text: str) -> dict[str, Any]:
    """From a metrics page: "step" (the trainer's gauges of its last step), "staleness"
    (trained samples by versions behind: {"0": n, "1": n, ...}, from the histogram),
    "dropped" (trainer samples not trained, by reason) and "groups" (the sample builder's
    groups by outcome). Metrics the page lacks are left out."""
    from prometheus_client.parser import text_string_to_metric_families

    step: dict[str, float] = {}
    cumulative: list[tuple[float, float]] = []
    dropped: dict[str, float] = {}
    groups: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _STEP_GAUGES:
                step[_STEP_GAUGES[sample.name]] = round(sample.value, 6)
            elif sample.name == "harnessrl_trainer_sample_staleness_bucket":
                cumulative.append((float(sample.labels["le"]), sample.value))
            elif sample.name == "harnessrl_trainer_samples_dropped_total":
                dropped[sample.labels["reason"]] = sample.value
            elif sample.name == "harnessrl_samples_groups_total":
                groups[sample.labels["outcome"]] = sample.value
    return {
        "step": step,
        "staleness": _histogram(cumulative),
        "dropped": {k: int(v) for k, v in dropped.items()},
        "groups": {k: int(v) for k, v in groups.items()},
    }


def _histogram(cumulative: list[tuple[float, float]]) -> dict[str, int]:
    """Per-bucket counts from Prometheus' cumulative `le` buckets (integer versions)."""
    counts: dict[str, int] = {}
    below = 0.0
    for bound, total in sorted(cumulative):
        if total > below:
            label = f"{int(bound)}" if bound != float("inf") else "more"
            counts[label] = int(total - below)
        below = total
    return counts
