"""Episode tokens: what a harness carries so the gateway knows which episode a call is in.

The controller mints one per episode attempt and hands it to the harness inside its base URL
(`<gateway>/e/<token>/v1`) or as its API key; the gateway verifies it on every call. A token
is `<payload>.<mac>`, both base64url without padding: the payload is compact JSON of the
claims, the MAC is HMAC-SHA256 over the encoded payload with the shared secret. Nothing in
it is secret (the harness may read it); it cannot be forged or altered without the secret,
and it stops working at its expiry.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import orjson

Mode = Literal["train", "val"]
_VERSION = 1
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


class TokenError(Exception):
    """A token that must be refused; `reason` is "malformed", "forged" or "expired"."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EpisodeClaims:
    """Who a call belongs to, as the controller minted it."""

    episode_id: str
    attempt: int
    group_id: str
    mode: Mode
    expires_at: float  # unix seconds
    traceparent: str = ""  # W3C context of the episode span ("" when none)
    gateway: str = ""
    """The gateway replica that owns the episode (its `gateway.replica`); only it accepts the
    token. "" in a deployment of one unnamed gateway."""


def mint(claims: EpisodeClaims, secret: bytes) -> str:
    """The token for `claims`, signed with `secret` (at least 16 bytes)."""
    if len(secret) < 16:
        raise ValueError("token secret: must be at least 16 bytes")
    payload = _b64(
        orjson.dumps(
            {
                "v": _VERSION,
                "e": claims.episode_id,
                "a": claims.attempt,
                "g": claims.group_id,
                "m": claims.mode,
                "x": round(claims.expires_at, 3),
                "t": claims.traceparent,
                "r": claims.gateway,
            }
        )
    )
    return f"{payload}.{_b64(_mac(payload, secret))}"


def harness_env(gateway_url: str, token: str) -> dict[str, str]:
    """The variables that point a harness at the gateway as the episode of `token`: the
    OpenAI and Anthropic SDKs' base URLs, the token in the path, and their API keys (the
    token again, for harnesses that set their own base URL)."""
    base = gateway_url.rstrip("/")
    return {
        "OPENAI_BASE_URL": f"{base}/e/{token}/v1",
        "OPENAI_API_KEY": token,
        "ANTHROPIC_BASE_URL": f"{base}/e/{token}",
        "ANTHROPIC_API_KEY": token,
    }


def verify(token: str, secrets: Sequence[bytes], now: float | None = None) -> EpisodeClaims:
    """The claims of a valid token; raises TokenError otherwise.

    Any of `secrets` may have signed it (the first is the current one; the others let a
    rotation finish). Checks the signature before reading the payload, in constant time.
    Only the exact string `mint` made verifies: the MAC is compared as its canonical
    base64url text, so no other spelling of a valid token (extra characters, which a
    lenient decoder would skip, or other unused low bits) is accepted.
    """
    payload, dot, mac = token.partition(".")
    if not dot or not _BASE64URL.fullmatch(payload) or not _BASE64URL.fullmatch(mac):
        raise TokenError("malformed", "episode token: not <payload>.<mac> in base64url")
    given = mac.encode("ascii")
    if not any(hmac.compare_digest(given, _b64(_mac(payload, s)).encode()) for s in secrets):
        raise TokenError("forged", "episode token: signature does not match")
    try:
        data = orjson.loads(_unb64(payload))
        claims = EpisodeClaims(
            episode_id=str(data["e"]),
            attempt=int(data["a"]),
            group_id=str(data["g"]),
            mode=_mode(data["m"]),
            expires_at=float(data["x"]),
            traceparent=str(data["t"]),
            gateway=str(data.get("r", "")),
        )
    except (binascii.Error, ValueError, KeyError, TypeError, orjson.JSONDecodeError):
        raise TokenError("malformed", "episode token: payload is not valid claims") from None
    if claims.expires_at <= (time.time() if now is None else now):
        raise TokenError("expired", f"episode token: expired for episode {claims.episode_id}")
    return claims


def _mode(value: object) -> Mode:
    if value == "train":
        return "train"
    if value == "val":
        return "val"
    raise ValueError(f"mode {value!r}")


def _mac(payload: str, secret: bytes) -> bytes:
    return hmac.new(secret, payload.encode("ascii"), hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
