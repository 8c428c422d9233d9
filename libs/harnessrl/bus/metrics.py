"""Prometheus metrics of the bus, registered on the service's own registry."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from harnessrl.metrics import Labelled


class BusMetrics:
    """Counters and gauges shared by a service's producer and consumers."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.published = Labelled(
            Counter(
                "harnessrl_bus_published",
                "Records acknowledged by the broker.",
                ["topic"],
                registry=r,
            )
        )
        self.publish_retries = Labelled(
            Counter(
                "harnessrl_bus_publish_retries",
                "Records re-sent after a retryable failure.",
                ["topic"],
                registry=r,
            )
        )
        self.publish_rejected = Labelled(
            Counter(
                "harnessrl_bus_publish_rejected",
                "Records the broker refused for good.",
                ["topic"],
                registry=r,
            )
        )
        self.spilled = Counter(
            "harnessrl_bus_spilled", "Records written to the spill log.", registry=r
        )
        # Gauges are read at scrape time (see track_producer): nothing on the hot path.
        self.buffered_bytes = Gauge(
            "harnessrl_bus_buffered_bytes", "Bytes waiting in memory to be sent.", registry=r
        )
        self.in_flight_bytes = Gauge(
            "harnessrl_bus_in_flight_bytes", "Bytes sent and not yet acknowledged.", registry=r
        )
        self.spilled_bytes = Gauge(
            "harnessrl_bus_spilled_bytes", "Bytes waiting in the on-disk spill log.", registry=r
        )
        self.consumed = Labelled(
            Counter(
                "harnessrl_bus_consumed",
                "Records processed (or sent to the DLQ).",
                ["topic"],
                registry=r,
            )
        )
        self.dead_lettered = Labelled(
            Counter(
                "harnessrl_bus_dead_lettered",
                "Records sent to hrl.dlq.",
                ["topic", "stage"],
                registry=r,
            )
        )
        self.handler_retries = Labelled(
            Counter(
                "harnessrl_bus_handler_retries",
                "Retryable handler failures retried.",
                ["topic"],
                registry=r,
            )
        )
        self.handler_seconds = Labelled(
            Histogram(
                "harnessrl_bus_handler_seconds",
                "Time to process one record.",
                ["topic"],
                buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
                registry=r,
            )
        )
        self.commits = Labelled(
            Counter("harnessrl_bus_commits", "Offset commits.", ["outcome"], registry=r)
        )

    def track_producer(
        self,
        buffered: Callable[[], float],
        in_flight: Callable[[], float],
        spilled: Callable[[], float],
    ) -> None:
        """Have the producer gauges read these functions whenever metrics are scraped."""
        self.buffered_bytes.set_function(buffered)
        self.in_flight_bytes.set_function(in_flight)
        self.spilled_bytes.set_function(spilled)
