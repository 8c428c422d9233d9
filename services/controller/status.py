"""`harnessrl status`: what the topics say about groups and episodes."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

from harnessrl import events
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import KafkaSettings
from harnessrl.v1 import events_pb2 as pb


@dataclass
class Summary:
    groups_submitted: int = 0
    groups_complete: int = 0
    episodes_running: int = 0
    episodes_final: Counter[str] = field(default_factory=Counter)
    retried_attempts: int = 0
    by_version: dict[int, Counter[str]] = field(default_factory=dict)
    latest_version: int = 0
    versions_loaded: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "groups": {
                "submitted": self.groups_submitted,
                "complete": self.groups_complete,
                "in_progress": self.groups_submitted - self.groups_complete,
            },
            "episodes": {
                "running": self.episodes_running,
                "final": dict(self.episodes_final),
                "retried_attempts": self.retried_attempts,
            },
            "by_policy_version": {str(v): dict(c) for v, c in sorted(self.by_version.items())},
            "policy": {
                "latest_announced": self.latest_version,
                "engines_loaded": {str(v): n for v, n in self.versions_loaded.items()},
            },
        }


def summarise(
    tasks: list[pb.TaskSubmitted], episodes: list[tuple[str, Any]], policy: list[tuple[str, Any]]
) -> Summary:
    """The summary of the three topics' events (pure)."""
    summary = Summary(groups_submitted=len({t.group_id for t in tasks}))
    sizes = {t.group_id: t.group_size for t in tasks}
    open_attempts: set[tuple[str, int]] = set()
    done: dict[str, set[str]] = {}
    for kind, event in episodes:
        key = (event.episode_id, event.attempt)
        if kind == "episode_started":
            open_attempts.add(key)
            sizes[event.group_id] = sizes.get(event.group_id) or event.group_size
        elif kind == "episode_finished":
            open_attempts.discard(key)
            status = pb.EpisodeStatus.Name(event.status).removeprefix("EPISODE_STATUS_").lower()
            if event.final:
                summary.episodes_final[status] += 1
                summary.by_version.setdefault(event.policy_version, Counter())[status] += 1
                done.setdefault(event.group_id, set()).add(event.episode_id)
            else:
                summary.retried_attempts += 1
    summary.episodes_running = len(open_attempts)
    summary.groups_complete = sum(
        1 for g, finished in done.items() if sizes.get(g) and len(finished) >= sizes[g]
    )
    for kind, event in policy:
        if kind == "policy_version":
            summary.latest_version = max(summary.latest_version, event.version)
        elif kind == "policy_loaded" and event.ok:
            summary.versions_loaded[event.version] = (
                summary.versions_loaded.get(event.version, 0) + 1
            )
    return summary


async def collect(kafka: KafkaSettings) -> Summary:
    async def read(topic: str) -> list[tuple[str, Any]]:
        return [(k, e) async for k, e, _ in read_to_end(kafka, topic, client_id="harnessrl-status")]

    tasks = [e for _, e in await read(events.TASKS)]
    return summarise(tasks, await read(events.EPISODES), await read(events.POLICY))


def render(summary: Summary, *, as_json: bool) -> str:
    data = summary.as_dict()
    if as_json:
        return orjson.dumps(data).decode() + "\n"
    g, e = data["groups"], data["episodes"]
    lines = [
        f"groups    submitted {g['submitted']}, complete {g['complete']}, "
        f"in progress {g['in_progress']}",
        f"episodes  running {e['running']}, final {e['final'] or '{}'}, "
        f"retried attempts {e['retried_attempts']}",
        f"policy    latest announced v{data['policy']['latest_announced']}",
    ]
    for version, counts in data["by_policy_version"].items():
        lines.append(f"  v{version}: {counts}")
    return "\n".join(lines) + "\n"
