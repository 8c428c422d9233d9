"""Prometheus metrics of the gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from harnessrl.metrics import Labelled


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.calls = Labelled(
            Counter(
                "harnessrl_gateway_calls",
                "Harness calls by kind and outcome.",
                ["kind", "outcome"],
                registry=r,
            )
        )
        self.latency = Labelled(
            Histogram(
                "harnessrl_gateway_call_seconds",
                "Time from a call's arrival to its last byte.",
                ["kind"],
                buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120),
                registry=r,
            )
        )
        self.requests = Labelled(
            Counter(
                "harnessrl_gateway_requests",
                "Requests on the harness port by route template and HTTP status.",
                ["route", "status"],
                registry=r,
            )
        )
        self.clamped = Counter(
            "harnessrl_gateway_max_tokens_clamped",
            "Calls whose completion budget was lowered to the room their prompt left.",
            registry=r,
        )
        self.tools_dropped = Labelled(
            Counter(
                "harnessrl_gateway_tools_dropped",
                "Tools offered by a harness that the engine cannot run, left out, by type.",
                ["type"],
                registry=r,
            )
        )
        self.refused = Labelled(
            Counter(
                "harnessrl_gateway_refused",
                "Calls refused before reaching an engine.",
                ["reason"],
                registry=r,
            )
        )
        self.prompt_tokens = Counter(
            "harnessrl_gateway_prompt_tokens", "Prompt tokens of captured calls.", registry=r
        )
        self.completion_tokens = Counter(
            "harnessrl_gateway_completion_tokens",
            "Completion tokens of captured calls.",
            registry=r,
        )
        self.mismatches = Counter(
            "harnessrl_gateway_logprob_mismatches",
            "Captured choices whose log-probs and token ids differ in length.",
            registry=r,
        )
        self.closed = Counter(
            "harnessrl_gateway_episodes_closed",
            "Episodes closed (EpisodeClosed published).",
            registry=r,
        )
        self.sessions_started = Labelled(
            Counter(
                "harnessrl_gateway_sessions_started",
                "Production sessions opened, by app and whether they explore (train).",
                ["app", "explored"],
                registry=r,
            )
        )
        self.sessions_ended = Labelled(
            Counter(
                "harnessrl_gateway_sessions_ended",
                "Production sessions ended, by app and how (end | idle).",
                ["app", "ended_by"],
                registry=r,
            )
        )
        self.sessions_assigned = Labelled(
            Counter(
                "harnessrl_gateway_sessions_assigned",
                "Production sessions assigned an arm of a canary rollout (stable | candidate).",
                ["arm"],
                registry=r,
            )
        )
        self.version_switches = Counter(
            "harnessrl_gateway_session_version_switches",
            "Production sessions served from stable because their version was rolled back "
            "and no engine serves it any more (never in normal operation).",
            registry=r,
        )
        self.sessions_open = Gauge(
            "harnessrl_gateway_sessions_open",
            "Production sessions open on this replica.",
            registry=r,
        )
        self.episodes = Gauge(
            "harnessrl_gateway_episodes", "Episodes known to this replica.", registry=r
        )
        self.in_flight = Gauge("harnessrl_gateway_in_flight", "Calls in progress.", registry=r)
        self.paused = Gauge(
            "harnessrl_gateway_paused", "1 while calls are held (paused).", registry=r
        )

    def track(
        self,
        episodes: Callable[[], float],
        in_flight: Callable[[], float],
        paused: Callable[[], float],
    ) -> None:
        """Read the gauges from these functions at scrape time."""
        self.episodes.set_function(episodes)
        self.in_flight.set_function(in_flight)
        self.paused.set_function(paused)


class ServerBudgets:
    """The HTTP servers' request-body budgets, read at scrape time: bytes held now
    (`harnessrl_gateway_http_buffered_body_bytes{port}`) and bodies refused with 503 for
    want of room (`harnessrl_gateway_http_body_budget_refusals_total{port}`)."""

    def __init__(self, servers: Callable[[], Mapping[str, Any]]) -> None:
        self._servers = servers  # port name -> HttpServer (or None before it started)

    def collect(self) -> Iterator[Metric]:
        held = GaugeMetricFamily(
            "harnessrl_gateway_http_buffered_body_bytes",
            "Request-body bytes held across the port's connections.",
            labels=["port"],
        )
        refused = CounterMetricFamily(
            "harnessrl_gateway_http_body_budget_refusals",
            "Request bodies refused (503) because the port's buffered-bytes budget was full.",
            labels=["port"],
        )
        for name, server in self._servers().items():
            if server is not None:
                held.add_metric([name], server.buffered_bytes)
                refused.add_metric([name], server.budget_refusals)
        yield held
        yield refused
