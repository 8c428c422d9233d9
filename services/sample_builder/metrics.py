"""Prometheus metrics of the sample builder: where every group, episode and token went."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from harnessrl.metrics import Labelled
from harnessrl.trust.samples import Built
from harnessrl.v1 import events_pb2 as pb

_REWARD_BUCKETS = (-1, -0.5, 0, 0.25, 0.5, 0.75, 1, 2, 10)


class SampleMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.groups = Labelled(
            Counter(
                "harnessrl_samples_groups",
                "Groups finished, by outcome: emitted, val, zero_variance, too_few_episodes, "
                "publish_refused.",
                ["outcome"],
                registry=r,
            )
        )
        self.timed_out = Counter(
            "harnessrl_samples_groups_timed_out",
            "Groups built at group_timeout_s with what had arrived.",
            registry=r,
        )
        self.episodes_dropped = Labelled(
            Counter(
                "harnessrl_samples_episodes_dropped",
                "Episodes not trained on, by reason (invalid, failed, reward_missing, "
                "flagged, too_long, incomplete, ...).",
                ["reason"],
                registry=r,
            )
        )
        self.breaks = Labelled(
            Counter(
                "harnessrl_samples_merge_breaks",
                "Chain starts, by class: chat_template, retokenization, compaction, "
                "side_chain, other.",
                ["kind"],
                registry=r,
            )
        )
        self.duplicates = Counter(
            "harnessrl_samples_duplicate_calls_replaced",
            "Alternative calls (same prompt ids: retries, unused choices) not trained.",
            registry=r,
        )
        self.tokens = Labelled(
            Counter(
                "harnessrl_samples_tokens",
                "Tokens emitted: trained (loss mask 1) or context (mask 0).",
                ["kind"],
                registry=r,
            )
        )
        self.completion_tokens = Labelled(
            Counter(
                "harnessrl_samples_completion_tokens",
                "Captured completion tokens, by where they went: trained, or the reason "
                "they were dropped (the token books; a production session's when its "
                "samples are acknowledged, deleted when its app took it back first).",
                ["outcome"],
                registry=r,
            )
        )
        self.truncated = Counter(
            "harnessrl_samples_segments_truncated", "Segments cut at max_tokens.", registry=r
        )
        self.open_groups = Gauge(
            "harnessrl_samples_open_groups", "Groups waiting for events.", registry=r
        )
        self.build_seconds = Histogram(
            "harnessrl_samples_build_seconds",
            "Time to build one group.",
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1),
            registry=r,
        )
        self.sessions = Labelled(
            Gauge(
                "harnessrl_samples_sessions",
                "Production sessions in the session store, by state: waiting (for events or "
                "their reward), built (published, not yet acknowledged), published, dropped.",
                ["state"],
                registry=r,
            )
        )
        self.session_events = Labelled(
            Counter(
                "harnessrl_samples_session_events",
                "Events of production sessions, by what the store did: stored, duplicate "
                "(a redelivered copy), late (the session was decided), overflow (a copy past "
                "the bound on conflicting copies), deleted (the app deleted the session: "
                "not stored).",
                ["outcome"],
                registry=r,
            )
        )
        self.sessions_decided = Labelled(
            Counter(
                "harnessrl_samples_sessions_decided",
                "Production sessions leaving the wait, by outcome: built (samples stored for "
                "publication), published, dropped (not trained: see the groups counter for "
                "the reason), expired (dropped at production.retention_s), publish_refused, "
                "deleted (its app took it back).",
                ["outcome"],
                registry=r,
            )
        )
        self.session_turns = Labelled(
            Counter(
                "harnessrl_samples_session_turns",
                "Turns feedback credited, by whether a call of the session answered them: "
                "credited, unmatched.",
                ["match"],
                registry=r,
            )
        )
        self.reward = Labelled(
            Histogram(
                "harnessrl_samples_episode_reward",
                "Rewards of the episodes kept, by mode (train, val).",
                ["mode"],
                buckets=_REWARD_BUCKETS,
                registry=r,
            )
        )

    def observe(
        self, built: Built, mode: int, timed_out: bool, seconds: float, *, books: bool = True
    ) -> None:
        """Count a built group; its token books too unless `books` is False (they are
        counted later with count_books)."""
        self.groups(built.dropped or "emitted").inc()
        if timed_out:
            self.timed_out.inc()
        for dropped in built.episodes_dropped:
            self.episodes_dropped(dropped.reason.split(":", 1)[0]).inc()
        merge = built.merge
        self.breaks("chat_template").inc(merge.break_chat_template)
        self.breaks("retokenization").inc(merge.break_retokenization)
        self.breaks("compaction").inc(merge.break_compaction)
        self.breaks("side_chain").inc(merge.break_side_chain)
        self.breaks("other").inc(merge.break_other)
        if books:
            self.count_books(built.books)
        self.duplicates.inc(merge.duplicates_replaced)
        self.truncated.inc(built.truncated)
        self.build_seconds.observe(seconds)
        histogram = self.reward("val" if mode == pb.MODE_VAL else "train")
        for value in built.rewards:
            histogram.observe(value)
        if built.samples is not None:
            for sample in built.samples.samples:
                trained = int(np.count_nonzero(np.asarray(sample.loss_mask, dtype=bool)))
                self.tokens("trained").inc(trained)
                self.tokens("context").inc(len(sample.loss_mask) - trained)

    def count_books(self, books: pb.TokenBooks) -> None:
        """Where a group's captured completion tokens went."""
        self.completion_tokens("trained").inc(books.trained)
        for reason, tokens in books.dropped.items():
            self.completion_tokens(reason).inc(tokens)
