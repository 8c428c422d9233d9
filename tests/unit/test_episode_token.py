"""Episode tokens: valid ones verify, anything forged, altered or expired is refused."""

from __future__ import annotations

import base64
import hmac
import string
import time

import orjson
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


def _resigned_claims(token: str, **changes: object) -> str:
    """`token` with some claims changed in its payload and its old MAC kept."""
    payload, mac = token.split(".")
    data = orjson.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data.update(changes)
    forged = base64.urlsafe_b64encode(orjson.dumps(data)).rstrip(b"=").decode()
    return f"{forged}.{mac}"


@pytest.mark.parametrize(
    "changes",
    [
        {"e": "ep-2"},
        {"a": 3},
        {"g": "g-2"},
        {"m": "val"},
        {"x": CLAIMS.expires_at + 86_400},
        {"t": ""},
        {"v": 2},
    ],
)
def test_any_altered_claim_under_the_old_mac_is_refused_as_forged(
    changes: dict[str, object],
) -> None:
    with pytest.raises(TokenError) as info:
        verify(_resigned_claims(mint(CLAIMS, SECRET), **changes), [SECRET])
    assert info.value.reason == "forged"


def _other_low_bits(token: str) -> str:
    """The same token with the unused low bits of the MAC's last base64 character set."""
    alphabet = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
    last = alphabet[alphabet.index(token[-1]) ^ 1]  # 32 bytes: 43 chars, 2 bits unused
    return token[:-1] + last


def test_only_the_exact_minted_string_verifies() -> None:
    token = mint(CLAIMS, SECRET)
    variants = [token + "!!!!", token + "====", token + "\n", " " + token, _other_low_bits(token)]
    assert base64.urlsafe_b64decode(_other_low_bits(token).split(".")[1] + "=") == (
        base64.urlsafe_b64decode(token.split(".")[1] + "=")
    )  # a lenient decoder reads the same MAC from that spelling
    for variant in variants:
        with pytest.raises(TokenError):
            verify(variant, [SECRET])


@pytest.mark.parametrize(
    "token",
    [
        "eyJhbGciOiJub25lIn0.",  # an unsigned token, JWT alg=none style
        "eyJhbGciOiJub25lIn0.eyJlIjoiZXAtMSJ9.",  # a JWT-shaped header.payload.signature
        "eyJhbGciOiJub25lIn0..c2ln",
    ],
)
def test_tokens_without_a_mac_or_with_a_header_are_malformed(token: str) -> None:
    with pytest.raises(TokenError) as info:
        verify(token, [SECRET])
    assert info.value.reason == "malformed"


def test_a_token_expires_exactly_at_its_expiry_without_a_skew_margin() -> None:
    expires_at = round(time.time() + 60, 3)
    token = mint(EpisodeClaims("ep-1", 1, "g", "train", expires_at), SECRET)
    assert verify(token, [SECRET], now=expires_at - 0.001).episode_id == "ep-1"
    with pytest.raises(TokenError) as info:
        verify(token, [SECRET], now=expires_at)
    assert info.value.reason == "expired"


def test_a_rotated_out_secret_no_longer_verifies() -> None:
    old = b"o" * 32
    token = mint(CLAIMS, old)
    assert verify(token, [SECRET, old]).episode_id == "ep-1"
    with pytest.raises(TokenError) as info:
        verify(token, [SECRET])
    assert info.value.reason == "forged"


def test_the_mac_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[bytes] = []
    real = hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        compared.append(given)
        return real(given, expected)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    token = mint(CLAIMS, SECRET)
    verify(token, [SECRET])
    with pytest.raises(TokenError):
        verify(token, [b"x" * 32, b"y" * 32])
    assert compared == [token.split(".")[1].encode()] * 3  # once per secret tried
