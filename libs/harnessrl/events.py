"""Topics, envelopes and event identity: the one place that knows which event goes where.

Every event type lives on exactly one topic, inside that topic's envelope. Producers hand
this module a bare event (a `ModelCall`, a `RewardAssigned`, ...) and get back the topic, the
record key and a complete envelope; consumers hand it a topic and bytes and get back the
envelope or a `DecodeError` that says what is wrong.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError as _ProtobufDecodeError
from google.protobuf.message import Message

from harnessrl.v1 import events_pb2 as pb

SCHEMA_VERSION = 1
"""Version of events.proto this code writes (EventMeta.schema_version)."""

POLICY_KEY = "policy"
"""Record key of every event on hrl.policy (one partition, total order)."""

TASKS = "hrl.tasks"
EPISODES = "hrl.episodes"
CALLS = "hrl.calls"
REWARDS = "hrl.rewards"
SAMPLES = "hrl.samples"
POLICY = "hrl.policy"
DLQ = "hrl.dlq"


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """A topic, the envelope its records carry, and how many partitions it must have."""

    name: str
    envelope: type[Message] | None  # None for hrl.dlq, whose values are foreign bytes
    single_partition: bool = False


TOPICS: dict[str, TopicSpec] = {
    spec.name: spec
    for spec in (
        TopicSpec(TASKS, pb.TaskEnvelope),
        TopicSpec(EPISODES, pb.EpisodeEnvelope),
        TopicSpec(CALLS, pb.CallEnvelope),
        TopicSpec(REWARDS, pb.RewardEnvelope),
        TopicSpec(SAMPLES, pb.SampleEnvelope),
        TopicSpec(POLICY, pb.PolicyEnvelope, single_partition=True),
        TopicSpec(DLQ, None),
    )
}


class DecodeError(ValueError):
    """A record's value is not a valid envelope for its topic; the message says why."""


@dataclass(frozen=True, slots=True)
class _Route:
    topic: str
    envelope: type[Message]
    field: str  # name of the envelope's oneof field that holds this event type
    identity: Callable[[Any], str]
    tag: bytes  # wire-format tag of that field (length-delimited)
    prefix: str  # what every identity of this event type starts with ("call/", ...)


def _routes() -> dict[type[Message], _Route]:
    table: list[tuple[type[Message], str, str, Callable[[Any], str]]] = [
        (pb.TaskSubmitted, TASKS, "task_submitted", lambda e: f"task/{e.group_id}"),
        (
            pb.EpisodeStarted,
            EPISODES,
            "episode_started",
            lambda e: f"episode-started/{e.episode_id}/{e.attempt}",
        ),
        (
            pb.EpisodeFinished,
            EPISODES,
            "episode_finished",
            lambda e: f"episode-finished/{e.episode_id}/{e.attempt}",
        ),
        (pb.ModelCall, CALLS, "model_call", lambda e: f"call/{e.episode_id}/{e.attempt}/{e.seq}"),
        (
            pb.EpisodeClosed,
            CALLS,
            "episode_closed",
            lambda e: f"episode-closed/{e.episode_id}/{e.attempt}",
        ),
        (
            pb.RewardAssigned,
            REWARDS,
            "reward_assigned",
            lambda e: f"reward/{e.episode_id}/{e.attempt}",
        ),
        (pb.GroupSamples, SAMPLES, "group_samples", lambda e: f"samples/{e.group_id}"),
        (pb.PolicyVersion, POLICY, "policy_version", lambda e: f"policy-version/{e.version}"),
        (
            pb.PolicyLoaded,
            POLICY,
            "policy_loaded",
            lambda e: f"policy-loaded/{e.version}/{e.engine}",
        ),
        (pb.ControlCommand, POLICY, "control_command", lambda e: f"control/{e.command_id}"),
        (pb.SessionDeleted, POLICY, "session_deleted", lambda e: f"session-deleted/{e.group_id}"),
        (
            pb.SessionDeletionApplied,
            POLICY,
            "session_deletion_applied",
            lambda e: f"session-deletion-applied/{e.group_id}",
        ),
        (
            pb.RolloutDecision,
            POLICY,
            "rollout_decision",
            lambda e: f"rollout/{e.decision_id}",
        ),
    ]
    routes = {}
    for cls, topic, field, identity in table:
        envelope = TOPICS[topic].envelope
        assert envelope is not None
        number = envelope.DESCRIPTOR.fields_by_name[field].number
        prefix = identity(cls()).partition("/")[0] + "/"
        routes[cls] = _Route(topic, envelope, field, identity, varint(number << 3 | 2), prefix)
    return routes


def varint(value: int) -> bytes:
    """`value` as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_META_TAG = varint(1 << 3 | 2)  # EventMeta meta = 1 in every envelope


_ROUTES = _routes()

EVENT_TYPES: tuple[type[Message], ...] = tuple(_ROUTES)
"""Every event type, in ARCHITECTURE.md order."""


def topic_of(event: Message) -> str:
    """The topic an event is published on. Raises TypeError for a non-event message."""
    return _route(event).topic


def topic_for(event_type: type[Message]) -> str:
    """The topic events of `event_type` are published on. Raises TypeError for a non-event."""
    try:
        return _ROUTES[event_type].topic
    except KeyError:
        raise TypeError(f"{event_type.__name__} is not a harnessrl event") from None


def kind_of(event: Message) -> str:
    """The name of the envelope field that carries `event` ("model_call", ...)."""
    return _route(event).field


def event_id(event: Message) -> str:
    """The event's stable identity (EventMeta.event_id), derived from what it describes."""
    return _route(event).identity(event)


def event_key(event: Message) -> str:
    """The record key: the event's group id, or "policy" for events on hrl.policy."""
    route = _route(event)
    if route.topic == POLICY:
        return POLICY_KEY
    key: str = getattr(event, "group_id")  # noqa: B009 - every non-policy event has one
    if not key:
        raise ValueError(f"{type(event).__name__}.group_id: must be set (it is the record key)")
    return key


def wrap(event: Message, *, producer: str, event_id_: str | None = None) -> Message:
    """The envelope of `event` for its topic, with EventMeta filled in.

    `event_id_` overrides the derived identity (for events whose identity the caller owns);
    it must keep the type's prefix (`call/`, `reward/`, ...), which decode() checks.
    """
    route = _route(event)
    envelope = route.envelope()
    getattr(envelope, "meta").CopyFrom(_meta(route, event, producer, event_id_))  # noqa: B009
    getattr(envelope, route.field).CopyFrom(event)
    return envelope


def encode(event: Message, *, producer: str, event_id_: str | None = None) -> bytes:
    """The serialised envelope of `event`: the same bytes as
    wrap(...).SerializeToString(deterministic=True).

    Written field by field (meta, then the event), which is how protobuf orders an
    envelope's fields, so the event is serialised once and never copied into an envelope.
    Deterministic (map entries sorted by key), so the same event always encodes to the same
    bytes.
    """
    route = _route(event)
    meta_bytes = _meta(route, event, producer, event_id_).SerializeToString(deterministic=True)
    event_bytes = event.SerializeToString(deterministic=True)
    return b"".join(
        (
            _META_TAG,
            varint(len(meta_bytes)),
            meta_bytes,
            route.tag,
            varint(len(event_bytes)),
            event_bytes,
        )
    )


def unwrap(envelope: Message) -> tuple[pb.EventMeta, str, Message]:
    """(meta, event field name, event) of an envelope. Raises DecodeError when it is empty."""
    field = envelope.WhichOneof("event")
    if field is None:
        raise DecodeError(f"{type(envelope).__name__}: carries no event (unknown event type?)")
    meta: pb.EventMeta = getattr(envelope, "meta")  # noqa: B009 - every envelope has one
    return meta, field, getattr(envelope, field)


def decode(topic: str, value: bytes | None) -> Message:
    """Parse a record value of `topic` into its envelope and check it is well-formed.

    Raises DecodeError naming the problem: unknown topic, empty value, bytes that are not the
    topic's envelope, an envelope without event, a missing event id, or one of another event
    type. (Envelopes share field numbers, so the bytes of another topic's envelope parse as
    this topic's event, with its fields read as this event's: only the id tells.)
    """
    spec = TOPICS.get(topic)
    if spec is None or spec.envelope is None:
        raise DecodeError(f"topic {topic!r}: carries no harnessrl envelope")
    if not value:
        raise DecodeError(f"{topic}: empty record value")
    envelope = spec.envelope()
    try:
        envelope.ParseFromString(value)
    except _ProtobufDecodeError as err:
        raise DecodeError(f"{topic}: not a {spec.envelope.__name__}: {err}") from err
    meta, kind, event = unwrap(envelope)
    if not meta.event_id:
        raise DecodeError(f"{topic}: meta.event_id is empty")
    prefix = _ROUTES[type(event)].prefix
    if not meta.event_id.startswith(prefix):
        raise DecodeError(
            f"{topic}: meta.event_id {meta.event_id[:100]!r} is not the id of a {kind} "
            f"(which starts with {prefix!r}): an event of another type?"
        )
    return envelope


def to_dict(message: Message) -> dict[str, Any]:
    """JSON-ready dict of a message (proto field names, enums by name, defaults omitted)."""
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _meta(route: _Route, event: Message, producer: str, event_id_: str | None) -> pb.EventMeta:
    meta = pb.EventMeta(
        event_id=event_id_ or route.identity(event),
        producer=producer,
        schema_version=SCHEMA_VERSION,
    )
    meta.created_at.FromNanoseconds(time.time_ns())
    return meta


def _route(event: Message) -> _Route:
    try:
        return _ROUTES[type(event)]
    except KeyError:
        raise TypeError(f"{type(event).__name__} is not a harnessrl event") from None
