"""Episode tokens: valid ones verify, anything forged, altered or expired is refused."""

from __future__ import annotations

import time

import pytest

from harnessrl.episode_token import EpisodeClaims, TokenError, mint, verify

SECRET = b"s" * 32
CLAIMS = EpisodeClaims(
    "ep-1",
    2,
    "g-1",
    "train",
    time.time() + 86_400,
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
)


def test_a_minted_token_verifies_to_its_claims() -> None:
    token = mint(CLAIMS, SECRET)
    assert verify(token, [SECRET]) == EpisodeClaims(
        CLAIMS.episode_id,
        CLAIMS.attempt,
        CLAIMS.group_id,
        CLAIMS.mode,
        round(CLAIMS.expires_at, 3),
        CLAIMS.traceparent,
    )
    assert all(c.isalnum() or c in "-_." for c in token)  # safe in a URL path


def test_a_previous_secret_still_verifies_during_rotation() -> None:
    old = b"o" * 32
    assert verify(mint(CLAIMS, old), [SECRET, old]).episode_id == "ep-1"


def test_another_secret_is_refused_as_forged() -> None:
    with pytest.raises(TokenError) as info:
        verify(mint(CLAIMS, b"x" * 32), [SECRET])
    assert info.value.reason == "forged"


def test_an_altered_payload_is_refused_as_forged() -> None:
    token = mint(CLAIMS, SECRET)
    other = mint(EpisodeClaims("ep-2", 2, "g-1", "train", CLAIMS.expires_at), SECRET)
    spliced = other.split(".")[0] + "." + token.split(".")[1]
    with pytest.raises(TokenError) as info:
        verify(spliced, [SECRET])
    assert info.value.reason == "forged"


def test_an_expired_token_is_refused() -> None:
    token = mint(EpisodeClaims("ep-1", 1, "g", "val", time.time() - 1), SECRET)
    with pytest.raises(TokenError, match="expired for episode ep-1") as info:
        verify(token, [SECRET])
    assert info.value.reason == "expired"


@pytest.mark.parametrize("token", ["", "abc", "abc.", ".abc", "abc.%%%", "a.b.c"])
def test_garbage_is_refused_as_malformed_or_forged(token: str) -> None:
    with pytest.raises(TokenError) as info:
        verify(token, [SECRET])
    assert info.value.reason in ("malformed", "forged")


def test_short_secrets_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        mint(CLAIMS, b"short")
