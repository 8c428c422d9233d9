"""`n: 2` end to end: a harness asks the real gateway for two choices, goes on with one,
and the trainer trains the one it went on with; the other is in the group's token books as
`unused_choice`.

Real parts: the embedded broker, the project's engine and the gateway on loopback (the
completions API with token-id prompts, as a harness that keeps its own ids calls it), the
sample builder and the trainer; only the controller and the reward are played by hand
(their events published as they would publish them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from tests.helpers import eventually
from tests.integration.gateway_stack import ADMIN, Stack, running_stack
from tests.integration.test_sample_builder import (
    outcome_events,
    publish,
    sample_builder,
    samples_on_topic,
)
from tests.integration.test_trainer import TINY, trained_ids, trainer

pytestmark = pytest.mark.integration

GROUP = "g-choices"
PROMPT = [5, 17, 42, 8, 99, 3]


async def _episode(
    stack: Stack, client: httpx.AsyncClient, index: int, keep: int
) -> tuple[list[int], list[int]]:
    """Play one episode: a call with two choices, then one that goes on from choice
    `keep`. Returns (the choice kept, the other one) as token ids."""
    episode = f"{GROUP}-{index}"
    base = stack.openai_base(stack.token(episode=episode, group=GROUP))
    body: dict[str, Any] = {"model": "policy", "max_tokens": 4, "return_token_ids": True}
    first = await client.post(f"{base}/completions", json={**body, "prompt": PROMPT, "n": 2})
    assert first.status_code == 200, first.text
    choices = [c["token_ids"] for c in sorted(first.json()["choices"], key=lambda c: c["index"])]
    assert len(choices) == 2
    going_on = [*PROMPT, *choices[keep], 7, 7]
    second = await client.post(f"{base}/completions", json={**body, "prompt": going_on})
    assert second.status_code == 200, second.text
    closed = await client.post(
        f"{stack.admin_url}/admin/episodes/{episode}/close",
        json={"attempt": 1, "group_id": GROUP},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert closed.status_code == 200, closed.text
    return choices[keep], choices[1 - keep]


async def test_the_choice_the_harness_went_on_with_is_trained_the_other_booked(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with (
        running_stack(broker, tmp_path, TINY) as stack,
        sample_builder(broker, tmp_path),
        trainer(broker, tmp_path, batch_groups=1, max_staleness=1000) as training,
        httpx.AsyncClient(timeout=60) as client,
    ):
        kept = [await _episode(stack, client, 0, keep=0), await _episode(stack, client, 1, keep=1)]
        await publish(
            broker, tmp_path, outcome_events(GROUP, 0, 0.0) + outcome_events(GROUP, 1, 1.0)
        )
        (group,) = await samples_on_topic(broker, 1)

        async def stepped() -> bool:
            return training.step >= 1

        await eventually(stepped, timeout=120, interval=0.5)
        trained = trained_ids(tmp_path)
    calls = [c for c in await stack.calls() if c.group_id == GROUP]
    assert sorted((c.episode_id, c.seq) for c in calls) == [
        (f"{GROUP}-{i}", s) for i in range(2) for s in range(3)
    ]
    by_episode = {s.episode_id: s for s in group.samples}
    assert sorted(by_episode) == [f"{GROUP}-0", f"{GROUP}-1"]
    for index, (choice, _) in enumerate(kept):
        sample = by_episode[f"{GROUP}-{index}"]
        # Choice 0 is seq 0, choice 1 seq 1 (one span); the call that went on is seq 2.
        assert list(sample.call_seqs) == [index, 2]
        mask = list(sample.loss_mask)
        ids = list(sample.token_ids)
        trained_tokens = [t for t, m in zip(ids, mask, strict=True) if m]
        last = next(c for c in calls if c.episode_id == sample.episode_id and c.seq == 2)
        assert trained_tokens == [*choice, *last.completion_token_ids]
        assert sample.sample_id in trained  # the trainer stepped on it
    unused = sum(len(other) for _, other in kept)
    books = group.books
    assert books.dropped["unused_choice"] == unused
    assert books.captured == books.trained + unused
    assert group.merge.duplicates_replaced == 2 and group.merge.break_chat_template == 0
    assert events.to_dict(group)["books"]["dropped"]["unused_choice"] == str(unused)
