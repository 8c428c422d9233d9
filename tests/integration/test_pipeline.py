"""Every service on real events, end to end: tasks → controller → a real harness → gateway →
engine; reward; sample builder; trainer. The books must balance: every call the gateway
answered is in a trained sample or accounted for with a reason; and one episode's trace
leads from its calls to the group span and to the gradient step that used them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from prometheus_client import CollectorRegistry

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.telemetry.jsonl import JsonLinesSpanExporter, read_spans
from harnessrl.telemetry.tracetree import episode_path, from_otlp, render
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import events_on, eventually
from tests.integration.gateway_stack import running_stack
from tests.integration.test_controller import _submit, _task, calc_model, controller
from tests.integration.test_reward import reward_service
from tests.integration.test_sample_builder import sample_builder
from tests.integration.test_trainer import trained_ids, trainer

pytestmark = pytest.mark.integration
__all__ = ["calc_model"]  # fixture used here

REWARD = "entrypoint:tests.integration.workers.rewards:by_index"


@pytest.fixture
def spans_file(tmp_path: Path) -> Iterator[tuple[TracerProvider, Path]]:
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    yield provider, path
    provider.shutdown()


async def test_every_answered_call_is_trained_or_accounted_for_and_traced_to_its_step(
    broker: EmbeddedBroker,
    tmp_path: Path,
    calc_model: Path,
    spans_file: tuple[TracerProvider, Path],
) -> None:
    provider, path = spans_file
    registry = CollectorRegistry()
    async with (
        running_stack(broker, tmp_path, calc_model, tracer_provider=provider) as stack,
        controller(stack, tmp_path, tracer_provider=provider),
        reward_service(broker, tmp_path, tracer_provider=provider, source=REWARD),
        sample_builder(broker, tmp_path, registry=registry, tracer_provider=provider),
        trainer(
            broker,
            tmp_path,
            tracer_provider=provider,
            model=calc_model,
            batch_groups=1,
            checkpoint_every=1,
            max_staleness=1000,
        ) as training,
    ):
        await _submit(
            broker.bootstrap,
            tmp_path,
            _task("p-a", {"question": "What is 17 + 25?"}, size=3, split=pb.MODE_TRAIN),
            _task("p-b", {"question": "What is 17 + 25?"}, size=3, split=pb.MODE_TRAIN),
            _task("p-val", {"question": "What is 17 + 25?"}, size=2, split=pb.MODE_VAL),
        )

        async def trained_both() -> bool:
            return training.step >= 2

        await eventually(trained_both, timeout=240, interval=0.5)

        async def val_counted() -> bool:
            value = registry.get_sample_value("harnessrl_samples_groups_total", {"outcome": "val"})
            return value == 1

        await eventually(val_counted, timeout=60, interval=0.5)
        trained = trained_ids(tmp_path)

    calls = [
        e for kind, e in await events_on(broker.bootstrap, events.CALLS) if kind == "model_call"
    ]
    finals = {
        e.episode_id: e.attempt
        for kind, e in await events_on(broker.bootstrap, events.EPISODES)
        if kind == "episode_finished" and e.final
    }
    groups = {e.group_id: e for kind, e in await events_on(broker.bootstrap, events.SAMPLES)}
    assert set(groups) == {"p-a", "p-b", "p-val"}
    # The val group is evaluated, never trained: published without samples, for its books.
    assert not groups["p-val"].samples and groups["p-val"].dropped_reason == "val"
    assert groups["p-val"].books.captured == groups["p-val"].books.dropped["val"] > 0
    books: dict[str, int] = {}
    for call in calls:
        reason = _account(call, finals, groups, trained)
        books[reason] = books.get(reason, 0) + 1
    assert sum(books.values()) == len(calls) > 0
    assert "unaccounted" not in books, books
    assert books.get("trained", 0) >= 6  # 2 groups x 3 episodes x at least one call
    # One episode's trace: its calls, the group span that used them, the step that used it.
    spans = [from_otlp(s) for s in read_spans(path)]
    found = episode_path(spans, "p-a-0")
    assert found is not None
    assert [g.attributes.get("harnessrl.group_id") for g in found.groups] == ["p-a"]
    assert len(found.steps) == 1 and found.seqs
    text = render(found)
    assert "samples.group" in text and "trainer.step" in text


def _account(
    call: pb.ModelCall,
    finals: dict[str, int],
    groups: dict[str, pb.GroupSamples],
    trained: set[str],
) -> str:
    if finals.get(call.episode_id) != call.attempt:
        return "retried attempt"
    if call.group_id == "p-val":
        return "val group"
    group = groups.get(call.group_id)
    if group is None:
        return "unaccounted"
    for dropped in group.dropped:
        if dropped.episode_id == call.episode_id:
            return f"episode dropped: {dropped.reason}"
    for sample in group.samples:
        if sample.episode_id == call.episode_id and call.seq in sample.call_seqs:
            return "trained" if sample.sample_id in trained else "unaccounted"
    return "duplicate replaced" if group.merge.duplicates_replaced else "unaccounted"
