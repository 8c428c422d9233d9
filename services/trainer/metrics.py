"""Prometheus metrics of the trainer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from harnessrl.metrics import Labelled
from harnessrl.trust.step import StepStats


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.steps = Counter("harnessrl_trainer_steps", "Optimiser steps taken.", registry=r)
        self.version = Gauge("harnessrl_trainer_policy_version", "Newest version.", registry=r)
        self.loss = Gauge("harnessrl_trainer_loss", "Loss of the last step.", registry=r)
        self.clip = Gauge(
            "harnessrl_trainer_clip_fraction", "Trained tokens clipped, last step.", registry=r
        )
        self.kl = Gauge("harnessrl_trainer_kl", "KL to the reference, last step.", registry=r)
        self.entropy = Gauge(
            "harnessrl_trainer_entropy", "Mean policy entropy per trained token.", registry=r
        )
        self.grad_norm = Gauge(
            "harnessrl_trainer_grad_norm", "Gradient norm before clipping.", registry=r
        )
        self.mismatch = Gauge(
            "harnessrl_trainer_logprob_mismatch",
            "Mean |trainer - engine log-prob| per trained token on the step's pass.",
            registry=r,
        )
        self.tokens_per_s = Gauge(
            "harnessrl_trainer_tokens_per_second", "Sequence tokens per second, last step.",
            registry=r,
        )  # fmt: skip
        self.published_bytes = Gauge(
            "harnessrl_trainer_published_bytes",
            "Tensor bytes of the last published version: what one weight sync moves per "
            "engine (the adapter pairs only under trainer.lora).",
            registry=r,
        )
        self.rewinds = Counter(
            "harnessrl_trainer_rewinds",
            "Rewinds of the weights to the stable version after a canary rollback.",
            registry=r,
        )
        self.step_seconds = Histogram(
            "harnessrl_trainer_step_seconds",
            "Time of one optimiser step.",
            buckets=(0.01, 0.1, 0.5, 1, 5, 30, 120, 600),
            registry=r,
        )
        self.staleness = Histogram(
            "harnessrl_trainer_sample_staleness",
            "Versions between a trained sample's oldest call and the policy it trained.",
            buckets=(0, 1, 2, 3, 4, 8, 16),
            registry=r,
        )
        self.samples_dropped = Labelled(
            Counter(
                "harnessrl_trainer_samples_dropped",
                "Samples not trained on, by reason (stale, too_stale, rolled_back, deleted, "
                "trained).",
                ["reason"],
                registry=r,
            )
        )
        self.tokens_dropped = Labelled(
            Counter(
                "harnessrl_trainer_tokens_dropped",
                "Loss-mask tokens of samples the builder emitted that no step trained, by "
                "reason (stale, too_stale, rolled_back, deleted): the trainer's part of the "
                "token books.",
                ["reason"],
                registry=r,
            )
        )

    def observe(self, stats: StepStats, version: int) -> None:
        self.steps.inc()
        self.version.set(version)
        self.loss.set(stats.loss)
        self.clip.set(stats.clip_fraction)
        self.kl.set(stats.kl)
        self.entropy.set(stats.entropy)
        self.grad_norm.set(stats.grad_norm)
        self.mismatch.set(stats.mismatch)
        self.tokens_per_s.set(stats.sequence_tokens / max(stats.seconds, 1e-9))
        self.step_seconds.observe(stats.seconds)
