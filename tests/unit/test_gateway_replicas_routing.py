"""Which gateway replica owns an episode, and what the controller accepts as replicas."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from pydantic import SecretStr, ValidationError

from harnessrl.episode_token import EpisodeClaims, mint, verify
from harnessrl.services.controller.config import ControllerSection, GatewayReplica
from harnessrl.services.controller.gateway_admin import owner

SECRET = b"replica-routing-secret-0123456789"


def replicas(n: int) -> list[GatewayReplica]:
    return [GatewayReplica(name=f"gateway-{i}", url=f"http://gateway-{i}:8000") for i in range(n)]


def test_episodes_spread_evenly_and_a_new_replica_takes_only_its_share() -> None:
    episodes = [f"g-{i:05d}-{j}" for i in range(1000) for j in range(4)]
    three = {e: owner(e, replicas(3)).name for e in episodes}
    counts = Counter(three.values())
    assert all(abs(n - len(episodes) / 3) < 0.1 * len(episodes) / 3 for n in counts.values())
    four = {e: owner(e, replicas(4)).name for e in episodes}
    moved = [e for e in episodes if four[e] != three[e]]
    assert all(four[e] == "gateway-3" for e in moved)  # only to the new replica
    assert abs(len(moved) - len(episodes) / 4) < 0.1 * len(episodes) / 4
    # the order replicas are listed in does not matter
    assert all(owner(e, replicas(3)[::-1]).name == three[e] for e in episodes[:200])


def test_the_token_names_its_replica_and_an_older_token_names_none() -> None:
    claims = EpisodeClaims("e", 1, "g", "train", time.time() + 60, gateway="gateway-2")
    assert verify(mint(claims, SECRET), [SECRET]).gateway == "gateway-2"
    unnamed = EpisodeClaims("e", 1, "g", "train", time.time() + 60)
    assert verify(mint(unnamed, SECRET), [SECRET]).gateway == ""


def test_the_controller_takes_named_replicas_or_one_unnamed_gateway() -> None:
    secrets = {"token_secret": SecretStr("s" * 32), "admin_token": SecretStr("a" * 32)}
    one = ControllerSection(gateway_url="http://gw:8000", **secrets)
    assert [(r.name, r.url) for r in one.replicas] == [("", "http://gw:8000")]
    three = ControllerSection(gateways=replicas(3), **secrets)
    assert [r.name for r in three.replicas] == ["gateway-0", "gateway-1", "gateway-2"]
    with pytest.raises(ValidationError, match="gateway-1 given twice"):
        ControllerSection(gateways=[*replicas(2), replicas(2)[1]], **secrets)
    with pytest.raises(ValidationError, match="is not an http"):
        ControllerSection(gateways=[{"name": "a", "url": "gw:8000"}], **secrets)
    with pytest.raises(ValidationError, match="name"):
        ControllerSection(gateways=[{"name": "", "url": "http://gw:8000"}], **secrets)
    with pytest.raises(ValidationError, match="give the replicas or gateway_url"):
        ControllerSection(gateways=replicas(2), gateway_url="http://gw:8000", **secrets)
