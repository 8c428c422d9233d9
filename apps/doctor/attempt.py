"""One episode's final attempt as the doctor's sections read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from harnessrl.apps.doctor.traffic_read import CallWire
from harnessrl.trust.merging import MergeResult
from harnessrl.v1 import events_pb2 as pb


@dataclass(slots=True)
class EpisodeView:
    episode_id: str
    group_id: str
    calls: list[pb.ModelCall]
    """Its calls below the close's call count, in seq order."""
    finished: pb.EpisodeFinished | None
    reward: pb.RewardAssigned | None
    merged: MergeResult | None = None
    """Its calls merged into chains (None: it made no call)."""
    wires: list[CallWire] = field(default_factory=list)
    """What each call carried, in `calls` order."""
