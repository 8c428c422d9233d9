"""A production session's arm in a canary rollout: the version its calls ask for, the
engines that may serve them, and the guard stats its owning replica keeps.

A session keeps the version it was assigned at its first call (production_sessions.py) to
its end: each call goes only to engines whose PolicyLoaded.serving lists that version, asked
under the model name the engine gave it. When none serves it right now (an engine
restarting, an adapter reloading) the call is refused with 503 and Retry-After, which the
SDKs retry, rather than served by another version. Only a version that was rolled back and
that no engine serves any more is given up: the session is served from stable from then on
(`Route.switched_from`), which normal operation never needs, since engines keep a
rolled-back version while sessions hold it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from harnessrl.rollout import Rollout
from harnessrl.services.gateway.engines import UpstreamError
from harnessrl.services.gateway.errors import GatewayError
from harnessrl.services.gateway.tool_markup import Answer
from harnessrl.services.gateway.versions import Served
from harnessrl.v1 import events_pb2 as pb


@dataclass(frozen=True, slots=True)
class Route:
    """Where one call of a session goes."""

    version: int
    """The version asked for."""
    engines: Mapping[str, str]
    """Engine URL -> the model name it serves `version` under ("": engine_model); not empty."""
    switched_from: int | None = None
    """The session's own version, when it was retired and served nowhere (else None)."""


def route(version: int, serving: Served, state: Rollout, *, retry_after_s: float) -> Route:
    """The engines for a call of a session assigned `version`. A version no engine serves
    now that the rollout still needs (stable, candidate, current: an engine restarting) is a
    503 with Retry-After; one it no longer needs (retired, or a stable replaced longer ago
    than the engines keep it, `production.canary.keep_s`) moves the session to stable.
    Raises GatewayError 503 when stable is served nowhere either."""
    engines = serving_engines(version, serving)
    if engines:
        return Route(version, engines)
    stable = state.stable
    needed = version in state.serving() and not state.retired(version)
    if not needed and stable is not None and stable != version:
        engines = serving_engines(stable, serving)
        if engines:
            return Route(stable, engines, switched_from=version)
    raise GatewayError(
        503,
        f"policy version {version}, which serves this session, is served by no engine right "
        "now (an engine may be restarting); retry",
        headers=[("retry-after", str(max(1, round(retry_after_s))))],
    )


def serving_engines(version: int, serving: Served) -> dict[str, str]:
    """Engine URL -> model name, of the engines serving `version`."""
    return {engine: models[version] for engine, models in serving.items() if version in models}


@dataclass(eq=False, slots=True)
class SessionCalls:
    """One session's routing and guard stats, kept by the replica that owns it."""

    version: int | None = None
    """The version its calls ask for; None: no arm (served as any call, the newest)."""
    arm: str = ""
    """Its arm ("stable" | "candidate"; "" when it has none)."""
    stats: pb.SessionStats = field(default_factory=pb.SessionStats)

    def route_call(self, serving: Served, state: Rollout, *, retry_after_s: float) -> Route:
        """Where its next call goes (`route`); a version given up for stable stays given up
        (`version` becomes stable). Raises GatewayError 503 as `route` does."""
        assert self.version is not None
        chosen = route(self.version, serving, state, retry_after_s=retry_after_s)
        if chosen.switched_from is not None:
            self.version = chosen.version
        return chosen

    def record(self, status: int, latency_ms: float, answer: Answer | None) -> None:
        """One call answered with HTTP `status` after `latency_ms`; `answer`: what the engine's
        200 answer held (None when it gave none)."""
        stats = self.stats
        stats.calls += 1
        if status >= 500:
            stats.errors += 1
        if answer is not None and answer.unparsed:
            stats.tool_parse_failures += 1
        stats.answered = (
            200 <= status < 300 and answer is not None and (answer.content or answer.tool_calls)
        )
        stats.latency_ms_sum += latency_ms
        stats.latency_ms_max = max(stats.latency_ms_max, latency_ms)


def call_status(outcome: str, err: BaseException | None) -> int:
    """The HTTP status a call was answered with (lifecycle.py's outcome, or what it raised),
    for the guard stats: an engine failing mid-stream counts as 502, a harness that left as
    499 (no failure)."""
    if isinstance(err, (GatewayError, UpstreamError)):
        return err.status
    if outcome == "ok":
        return 200
    if outcome.startswith("engine_") and outcome[7:].isdigit():
        return int(outcome[7:])
    if outcome in ("engine_error", "engine_cut"):
        return 502
    if outcome == "aborted" or (err is not None and not isinstance(err, Exception)):
        return 499
    return 500
