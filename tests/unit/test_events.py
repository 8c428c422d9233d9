"""Topic routing, identity, keys, and the envelope encoding."""

from __future__ import annotations

import pytest

from harnessrl import events
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import filled


def test_every_event_type_has_one_topic_and_an_envelope_field() -> None:
    assert len(events.EVENT_TYPES) == 13
    for cls in events.EVENT_TYPES:
        event = filled(cls)
        envelope = events.wrap(event, producer="test/0")
        meta, _kind, inner = events.unwrap(envelope)
        assert inner == event
        assert type(envelope) is events.TOPICS[events.topic_of(event)].envelope
        assert meta.event_id == events.event_id(event)
        assert meta.producer == "test/0"
        assert meta.schema_version == events.SCHEMA_VERSION


def test_encode_is_byte_identical_to_serialising_the_envelope() -> None:
    for cls in events.EVENT_TYPES:
        event = filled(cls, seed=3)
        own_id = events.event_id(event) + "-1"
        data = events.encode(event, producer="p/1", event_id_=own_id)
        envelope = events.decode(events.topic_of(event), data)
        expected = events.wrap(event, producer="p/1", event_id_=own_id)
        expected.meta.created_at.CopyFrom(envelope.meta.created_at)
        assert expected.SerializeToString(deterministic=True) == data


def test_identity_is_derived_from_what_the_event_describes() -> None:
    call = pb.ModelCall(episode_id="e1", attempt=2, group_id="g", seq=7)
    assert events.event_id(call) == "call/e1/2/7"
    assert events.event_id(pb.RewardAssigned(episode_id="e1", attempt=2)) == "reward/e1/2"
    assert events.event_id(pb.PolicyVersion(version=4)) == "policy-version/4"


def test_key_is_the_group_id_or_policy() -> None:
    assert events.event_key(pb.ModelCall(group_id="g-1")) == "g-1"
    assert events.event_key(pb.PolicyLoaded(version=1, engine="e")) == "policy"
    with pytest.raises(ValueError, match="group_id"):
        events.event_key(pb.ModelCall(episode_id="e"))


def test_non_event_messages_are_refused() -> None:
    with pytest.raises(TypeError, match="EventMeta is not a harnessrl event"):
        events.topic_of(pb.EventMeta())


@pytest.mark.parametrize(
    ("topic", "value", "reason"),
    [
        ("hrl.nope", b"x", "carries no harnessrl envelope"),
        ("hrl.dlq", b"x", "carries no harnessrl envelope"),
        ("hrl.calls", b"", "empty record value"),
        ("hrl.calls", b"\xff\xff\xff", "not a CallEnvelope"),
        (
            "hrl.calls",
            pb.CallEnvelope(meta=pb.EventMeta(event_id="x")).SerializeToString(),
            "carries no event",
        ),
        (
            "hrl.calls",
            pb.CallEnvelope(model_call=pb.ModelCall(seq=1)).SerializeToString(),
            "event_id is empty",
        ),
        (  # a ModelCall's envelope parses as a RewardEnvelope: field numbers are shared
            "hrl.rewards",
            events.encode(pb.ModelCall(episode_id="e", attempt=1, group_id="g"), producer="p"),
            "'call/e/1/0' is not the id of a reward_assigned",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "bytes",  # no clock in an id: xdist compares ids
)
def test_decode_names_what_is_wrong(topic: str, value: bytes, reason: str) -> None:
    with pytest.raises(events.DecodeError, match=reason):
        events.decode(topic, value)
