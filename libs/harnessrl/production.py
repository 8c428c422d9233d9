"""Production sessions: the apps a gateway serves, their session ids, and who trains.

A production app (a support desk, an IDE assistant) is configured under `production.apps`
with its own key, stored only as a SHA-256 digest. Each of its calls names a session of its
choosing (the `x-harnessrl-session` header, or `/s/<session>` in the base URL); the session
is one episode of a group of one, both named `s.<app>.<session>` (`session_group`), so
sessions of different apps never meet, and an app's key can only ever name its own.

Which sessions train is decided once, from the ids alone: a session is explored when the
hash of (app, session) falls in the app's exploration share, the same on every replica and
after every restart. Its trace is derived the same way (`session_traceparent`), so every
call, every feedback signal and the gradient step that used them share one trace without
any service remembering it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from harnessrl.config import Section
from harnessrl.rollout import CanarySection

SESSION_HEADER = "x-harnessrl-session"
"""Header naming the session of a call (or `/s/<session>/...` in the path)."""
KIND_HEADER = "x-harnessrl-kind"
"""Header labelling the session's kind (or `/k/<kind>/s/<session>/...` in the path)."""
END_HEADER = "x-harnessrl-session-end"
"""A call carrying this header with a true value ("1", "true") ends its session after it."""
SESSION_PREFIX = "s."
MAX_SESSION_ID = 128
MAX_KIND = 64
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_KIND = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_APP = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_session_id(value: object, field: str = "session") -> str:
    """`value` as a session id; ValueError naming `field` and the rule otherwise."""
    return _check(value, field, _SESSION_ID, MAX_SESSION_ID, "letters, digits and . _ : -")


def check_kind(value: object, field: str = "kind") -> str:
    """`value` as a session kind; ValueError naming `field` and the rule otherwise."""
    return _check(value, field, _KIND, MAX_KIND, "letters, digits and . _ -")


def _check(value: object, field: str, pattern: re.Pattern[str], limit: int, chars: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{field}: required, a non-empty string")
    if len(value) > limit:
        raise ValueError(f"{field}: {len(value)} characters, at most {limit}")
    if not pattern.fullmatch(value):
        raise ValueError(f"{field}: only {chars}, starting with a letter or digit")
    return value


def session_group(app: str, session_id: str) -> str:
    """The episode and group id of an app's session."""
    return f"{SESSION_PREFIX}{app}.{session_id}"


def parse_session_group(group_id: str) -> tuple[str, str] | None:
    """(app, session id) of a session's group id; None for a controller's group."""
    if not group_id.startswith(SESSION_PREFIX):
        return None
    app, dot, session = group_id[len(SESSION_PREFIX) :].partition(".")
    return (app, session) if dot and app and session else None


def _digest(app: str, session_id: str, purpose: bytes) -> bytes:
    return hashlib.sha256(purpose + b"\0" + app.encode() + b"\0" + session_id.encode()).digest()


def explored(app: str, session_id: str, share: float) -> bool:
    """Whether the session is in the exploration share: stable, from the ids alone."""
    if share <= 0.0:
        return False
    point = int.from_bytes(_digest(app, session_id, b"explore")[:8], "big") / 2.0**64
    return point < share


def session_traceparent(app: str, session_id: str) -> str:
    """The W3C traceparent every span of the session descends from (trace id and parent
    span id derived from the ids; the parent is a span no service records)."""
    digest = _digest(app, session_id, b"trace")
    return f"00-{digest[:16].hex()}-{digest[16:24].hex()}-01"


def key_digest(key: str) -> str:
    """The SHA-256 hex digest an app's key is configured as."""
    return hashlib.sha256(key.encode()).hexdigest()


class AppSpec(Section):
    """One production app: its name, its key (as a digest) and how much of it explores."""

    name: str
    """The app's name: lower-case letters, digits and -, at most 32 characters. Part of every
    session's group id (`s.<app>.<session>`)."""
    key_sha256: str
    """SHA-256 hex digest of the app's key (docs/production.md, "Register the app", makes
    a key and its digest); the key itself is never stored. The app sends the key as its API
    key."""
    exploration: float = Field(default=0.1, ge=0.0, le=1.0)
    """Share of the app's sessions served with sampling the trainer can recompute and
    trained from their feedback; the rest are served exactly as the app asks and only
    measured. Chosen by a hash of the session id: stable across replicas and restarts."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _APP.fullmatch(value):
            raise ValueError("lower-case letters, digits and -, starting with a letter or digit")
        return value

    @field_validator("key_sha256")
    @classmethod
    def _key(cls, value: str) -> str:
        value = value.lower()
        if not _SHA256.fullmatch(value):
            raise ValueError("the 64 hex digits of a SHA-256 digest")
        return value


class SignalRule(Section):
    """How one feedback signal counts."""

    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Its weight in the session reward (a weighted mean over the signals that arrived)."""
    train: bool = True
    """False: a held-out outcome, recorded and usable to judge a canary
    (`production.canary.signals`) but never part of the reward the policy is trained on."""
    required: bool = False
    """The session's reward is decided only once this signal arrived (or its window ended).
    With no required signal, the first signal after the session's end decides it."""
    min: float = Field(default=-1e6, allow_inf_nan=False)
    """Smallest value accepted (400 below)."""
    max: float = Field(default=1e6, allow_inf_nan=False)
    """Largest value accepted (400 above)."""


class FeedbackSection(Section):
    """Feedback: which signals an app may send, how they become a reward, how long to wait."""

    signals: dict[str, SignalRule] = {"thumbs": SignalRule(min=-1.0, max=1.0, required=True)}
    """The signals accepted, by name (others get 400). A session's reward is the weighted
    mean of its session-wide signals (a repeated name counts its latest value); a signal
    naming a response is credited to that turn only."""
    window_s: float = Field(default=86_400.0, ge=1.0, le=90 * 86_400.0)
    """How long after its end a session accepts feedback (and waits for it)."""
    at_window_end: Literal["train", "drop"] = "train"
    """A session whose window ended without every required signal: trained with what
    arrived (drop when nothing did: reward_missing), or dropped as reward_missing."""
    max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    """Largest feedback request body (413 beyond)."""

    @field_validator("signals")
    @classmethod
    def _one_trains(cls, value: dict[str, SignalRule]) -> dict[str, SignalRule]:
        if value and not any(rule.train for rule in value.values()):
            raise ValueError("signals: at least one signal must train (train: true)")
        return value


class BaselineSection(Section):
    """The baseline a session's reward is compared with (ARCHITECTURE.md, "Production
    sessions"): a running estimate per (app, kind)."""

    halflife: float = Field(default=200.0, gt=0)
    """Sessions after which an earlier reward weighs half as much in the estimate."""
    min_sessions: int = Field(default=10, ge=1)
    """Rewards a kind needs before its own estimate is used (before: its app's)."""
    scale: bool = False
    """Also divide by the running standard deviation (as grpo divides by the group's)."""


class ProductionSection(Section):
    """Production sessions: apps calling one fixed base URL, trained from later feedback."""

    apps: list[AppSpec] = []
    """The apps served; none: production sessions are off."""
    idle_s: float = Field(default=1800.0, gt=0)
    """A session with no call for this long ends on its own (`ended_by: idle`)."""
    max_open_sessions: int = Field(default=100_000, ge=1)
    """Most sessions one gateway replica holds open (a new session past it gets 503 with
    Retry-After until idle ones end), and as many ended ones it remembers, so that a call
    naming one is refused (409)."""
    feedback: FeedbackSection = FeedbackSection()
    """The feedback signals and their window."""
    baseline: BaselineSection = BaselineSection()
    """What a session's reward is compared with."""
    store: Path = Path(".harnessrl/sessions")
    """Directory of the services' session stores (SQLite): the reward service's sessions
    awaiting feedback, the sample builder's sessions awaiting their reward. Keep it on a
    persistent volume."""
    retention_s: float = Field(default=30 * 86_400.0, gt=0)
    """Longest any project-owned store keeps a session's data after it ended (trained or
    not); the broker's topics are bounded by their own retention (docs/security.md)."""
    canary: CanarySection = CanarySection()
    """Canary rollout: a new version serves a share of sessions until judged."""

    @field_validator("apps")
    @classmethod
    def _unique(cls, value: list[AppSpec]) -> list[AppSpec]:
        names = [a.name for a in value]
        keys = [a.key_sha256 for a in value]
        for label, items in (("name", names), ("key_sha256", keys)):
            if len(set(items)) != len(items):
                raise ValueError(f"apps[].{label}: each app needs its own")
        return value

    @model_validator(mode="after")
    def _retention_covers_window(self) -> ProductionSection:
        if self.retention_s < self.feedback.window_s:
            raise ValueError(
                "retention_s: must be at least feedback.window_s "
                f"({self.retention_s:g} < {self.feedback.window_s:g}): a session's data "
                "would go before its feedback could arrive"
            )
        return self


class Apps:
    """The configured apps, looked up by the key a request carries."""

    def __init__(self, apps: Sequence[AppSpec]) -> None:
        self._by_digest = {bytes.fromhex(a.key_sha256): a for a in apps}
        self._by_name = {a.name: a for a in apps}

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def by_key(self, key: str) -> AppSpec | None:
        """The app whose key this is, or None."""
        if not self._by_digest or not key:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        app = self._by_digest.get(digest)
        # The dict lookup found the candidate; the comparison itself is constant-time.
        if app is not None and hmac.compare_digest(bytes.fromhex(app.key_sha256), digest):
            return app
        return None

    def by_name(self, name: str) -> AppSpec | None:
        return self._by_name.get(name)
