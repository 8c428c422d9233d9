"""Dispatch by event type (harnessrl.service_bus): the one way a service handles events.
The broker side (commits after acknowledgement, holds, stopping) is
tests/integration/test_service_bus.py."""

from __future__ import annotations

from typing import Any, cast

import pytest
from google.protobuf.message import Message

from harnessrl import events
from harnessrl.bus import Context, Record
from harnessrl.service_bus import Subscription, dispatch
from harnessrl.v1 import events_pb2 as pb


def _record(event: Message) -> Record:
    meta = pb.EventMeta(event_id=events.event_id(event))
    topic = events.topic_of(event)
    return Record(topic, 0, 0, "g", 0, (), meta, events.kind_of(event), event)


async def test_each_event_goes_to_the_handler_of_its_type_and_other_types_are_skipped() -> None:
    got: list[tuple[str, Any, Any]] = []

    async def on_call(event: pb.ModelCall, ctx: Context) -> None:
        got.append(("call", event, ctx))

    async def on_closed(event: pb.EpisodeClosed, ctx: Context) -> None:
        got.append(("closed", event, ctx))

    handle = dispatch({pb.ModelCall: on_call, pb.EpisodeClosed: on_closed})
    ctx = cast(Context, object())
    call = pb.ModelCall(episode_id="e", attempt=1, group_id="g", seq=3)
    closed = pb.EpisodeClosed(episode_id="e", attempt=1, group_id="g", call_count=4)
    await handle(_record(call), ctx)
    await handle(_record(pb.EpisodeStarted(episode_id="e", attempt=1, group_id="g")), ctx)
    await handle(_record(closed), ctx)
    assert got == [("call", call, ctx), ("closed", closed, ctx)]


def test_a_subscription_consumes_the_topics_of_its_event_types_once_each() -> None:
    async def ignore(event: Any, ctx: Context) -> None:
        return None

    handlers = dict.fromkeys((pb.ModelCall, pb.EpisodeStarted, pb.EpisodeClosed), ignore)
    assert Subscription("g", handlers).topics == [events.CALLS, events.EPISODES]
    assert events.kind_of(pb.EpisodeClosed()) == "episode_closed"


def test_a_subscription_to_a_message_that_is_no_event_is_refused() -> None:
    async def ignore(event: Any, ctx: Context) -> None:
        return None

    with pytest.raises(TypeError, match="EventMeta is not a harnessrl event"):
        _ = Subscription("g", {pb.EventMeta: ignore}).topics
