"""`harnessrl policy` on the real embedded broker: hrl.policy holds the trainer's versions,
the engines' loads and the canary judge's decisions as the services publish them; the
command shows the rollout, publishes an operator's decisions, and refuses (exit 2, nothing
published) those that cannot apply."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.message import Message

from harnessrl import events
from harnessrl.apps.cli import main as cli_main
from harnessrl.apps.cli.policy import evidence_line
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.trust.canary import Canary, CanaryConfig, GuardRule, evidence
from harnessrl.v1 import events_pb2 as pb

pytestmark = pytest.mark.integration

ROLLBACK_FIRST = (
    "harnessrl policy rollback: version: 0 is the first stable version; nothing to roll back to"
)
PROMOTE_NONE = "harnessrl policy promote: no candidate is pending; name the VERSION to promote"


def judged_rollback() -> pb.RolloutDecision:
    """The judge's rollback of candidate 1 on the error guard, its evidence as the judge
    writes it (trust/canary's `evidence`)."""
    canary = Canary(CanaryConfig(min_sessions=20, guards={"error": GuardRule()}))
    for n in range(200):
        canary.observe("stable", 1.0, {"error": False})
        canary.observe("candidate", None, {"error": n % 2 == 0})  # half of its sessions fail
    verdict = canary.decide()
    assert (verdict.action, verdict.reason) == ("rollback", "error")
    return pb.RolloutDecision(
        decision_id="judge-2",
        action=pb.ROLLOUT_ACTION_ROLLBACK,
        version=1,
        stable=0,
        actor="canary",
        reason=verdict.reason,
        evidence_json=evidence(verdict).decode(),
    )


def history() -> list[Message]:
    """Versions 0..2; two engines (one failed to load 2); the judge started 1 and rolled it
    back; the trainer rewound to 0 and announced 3, which the judge started."""
    return [
        pb.PolicyVersion(version=0, step=0),
        pb.PolicyVersion(version=1, step=1, base=0),
        pb.PolicyLoaded(
            version=1,
            engine="engine-a",
            ok=True,
            serving=[pb.ServedVersion(version=v, model=f"m-v{v}") for v in (0, 1)],
        ),
        pb.RolloutDecision(
            decision_id="judge-1", action=pb.ROLLOUT_ACTION_START, version=1, stable=0,
            actor="canary", reason="new version", share=0.1,
        ),
        pb.PolicyVersion(version=2, step=2, base=1),
        pb.PolicyLoaded(version=0, engine="engine-b", ok=True),
        pb.PolicyLoaded(version=2, engine="engine-b", ok=False, error="checksum mismatch"),
        judged_rollback(),
        pb.PolicyVersion(version=3, step=3, base=0),
        pb.RolloutDecision(
            decision_id="judge-3", action=pb.ROLLOUT_ACTION_START, version=3, stable=0,
            actor="canary", reason="new version", share=0.25,
        ),
    ]  # fmt: skip


async def publish_all(broker: EmbeddedBroker, tmp_path: Path, items: list[Message]) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "spill"),
        name="test/policy",
    )
    await producer.start()
    for item in items:  # one by one: the topic's order is the fold's order
        await producer.publish(item)
    await producer.stop()


async def decisions(broker: EmbeddedBroker) -> list[pb.RolloutDecision]:
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    return [
        event
        async for kind, event, _ in read_to_end(kafka, events.POLICY, client_id="test-policy")
        if kind == "rollout_decision"
    ]


async def policy(broker: EmbeddedBroker, capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(cli_main, ["policy", *argv, "--bootstrap", broker.bootstrap])
    out, err = capsys.readouterr()
    return code, out, err


async def test_status_shows_the_rollout_the_engines_and_the_judges_evidence(
    broker: EmbeddedBroker, tmp_path: Path, capsys: Any
) -> None:
    code, out, _ = await policy(broker, capsys, "status")
    assert (code, out.strip()) == (0, "no policy version has been announced yet")
    await publish_all(broker, tmp_path, history())

    code, out, _ = await policy(broker, capsys, "status", "--json")
    assert code == 0
    shown = json.loads(out)
    assert shown["state"] == {
        "stable": 0,
        "candidate": 3,
        "share": 0.25,
        "pinned": False,
        "newest": 3,
        "current": 3,
        "serving": [0, 3],
        "rolled_back": [1],
        "stables": [0],
    }
    assert shown["engines"] == {
        "engine-a": {
            "serving": [{"version": 0, "model": "m-v0"}, {"version": 1, "model": "m-v1"}],
            "failed": None,
        },
        "engine-b": {"serving": [{"version": 0, "model": ""}], "failed": "v2: checksum mismatch"},
    }
    actions = [(d["action"], d["version"], d["actor"], d["refused"]) for d in shown["decisions"]]
    assert actions == [
        ("start", 1, "canary", None),
        ("rollback", 1, "canary", None),
        ("start", 3, "canary", None),
    ]
    rollback = shown["decisions"][1]
    assert rollback["evidence"]["sessions"] == {"stable": 200, "candidate": 200}
    assert rollback["evidence"]["guards"]["error"]["lower"] > 0.02

    code, text, _ = await policy(broker, capsys, "status")
    assert code == 0
    assert "stable       v0\n" in text
    assert "candidate    v3, 25% of new production sessions" in text
    assert "rolled back  v1\n" in text
    assert "engine-a  v0 (m-v0), v1 (m-v1)" in text
    assert "engine-b  v0; last load failed: v2: checksum mismatch" in text
    assert "rollback v1 by canary (error)" in text
    assert "sessions stable 200 / candidate 200 (rewarded 200 / 0)" in text
    assert "mean reward stable 1 / candidate -; promote" in text  # the candidate has no reward
    assert "promote above -0.05, roll back below 0" in text
    assert "error rate diff 0.5 in [" in text


async def test_operators_promote_pin_unpin_and_roll_back_and_refusals_publish_nothing(
    broker: EmbeddedBroker, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    await publish_all(broker, tmp_path, history())
    on_topic = len(await decisions(broker))

    refused = [
        (("promote", "9"), "promote: version: 9 was never announced by the trainer"),
        (("pin", "0"), "pin: version: candidate 3 is pending; promote or roll it back first"),
        (("promote", "2"), "promote: version: candidate 3 is pending, not 2"),
        (("unpin",), "unpin: unpin: no version is pinned"),
    ]
    for argv, message in refused:
        code, out, err = await policy(broker, capsys, *argv, "--by", "alice")
        assert (code, out, err.strip()) == (2, "", f"harnessrl policy {message}")
    assert len(await decisions(broker)) == on_topic  # nothing was published

    code, out, err = await policy(
        broker, capsys, "promote", "--by", "alice", "--reason", "looks good", "--json"
    )
    assert code == 0, err
    assert "harnessrl policy promote: applied" in err
    shown = json.loads(out)
    assert (shown["state"]["stable"], shown["state"]["candidate"]) == (3, None)
    promoted = (await decisions(broker))[-1]
    assert promoted.decision_id == shown["decision_id"]
    assert (promoted.action, promoted.version, promoted.stable) == (pb.ROLLOUT_ACTION_PROMOTE, 3, 0)
    assert (promoted.actor, promoted.reason, promoted.evidence_json) == (
        "operator:alice",
        "looks good",
        "",
    )
    assert promoted.decided_at.seconds > 0

    monkeypatch.setenv("USER", "bob")  # the operator's name defaults to $USER
    code, out, err = await policy(broker, capsys, "pin", "3", "--reason", "freeze for the demo")
    assert code == 0, err
    assert "stable       v3  (pinned" in out
    assert (await decisions(broker))[-1].actor == "operator:bob"
    code, _, err = await policy(broker, capsys, "rollback")
    assert (code, err.strip()) == (
        2,
        "harnessrl policy rollback: version: stable version 3 is pinned; unpin first",
    )
    code, _, err = await policy(broker, capsys, "unpin")
    assert code == 0, err

    # With none pending, rollback rolls stable back: 3 is retired, stable is 0 again, and
    # 0 is the trainer's line too (2 descends from 1, rolled back earlier).
    code, out, err = await policy(broker, capsys, "rollback", "--json")
    assert code == 0, err
    state = json.loads(out)["state"]
    assert (state["stable"], state["rolled_back"], state["current"]) == (0, [1, 3], 0)
    code, _, err = await policy(broker, capsys, "rollback")
    assert (code, err.strip()) == (2, ROLLBACK_FIRST)
    code, _, err = await policy(broker, capsys, "promote")
    assert (code, err.strip()) == (2, PROMOTE_NONE)
    actions = [(d.action, d.version, d.actor) for d in await decisions(broker)][on_topic:]
    assert actions == [
        (pb.ROLLOUT_ACTION_PROMOTE, 3, "operator:alice"),
        (pb.ROLLOUT_ACTION_PIN, 3, "operator:bob"),
        (pb.ROLLOUT_ACTION_UNPIN, 3, "operator:bob"),
        (pb.ROLLOUT_ACTION_ROLLBACK, 3, "operator:bob"),
    ]


async def test_bad_operator_input_is_one_clear_error(
    broker: EmbeddedBroker, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("USER", raising=False)
    code, _, err = await policy(broker, capsys, "unpin")
    assert (code, err.strip()) == (
        2,
        "harnessrl: error: --by: give the operator's name (no $USER to default to)",
    )
    code, _, err = await policy(broker, capsys, "pin", "latest", "--by", "alice")
    assert (code, err.strip()) == (
        2,
        "harnessrl: error: VERSION: 'latest' is not a policy version number",
    )
    code, _, err = await policy(broker, capsys, "pin", "1", "--by", "alice smith")
    assert code == 2 and "--by: 'alice smith' is not an operator name" in err
    assert await decisions(broker) == []
    code = await asyncio.to_thread(cli_main, ["policy", "status", "--bootstrap", "127.0.0.1:1"])
    _, err = capsys.readouterr()
    assert code == 2 and "harnessrl: error: cannot reach hrl.policy at 127.0.0.1:1" in err


def test_the_evidence_of_a_failed_load_names_the_engine_and_its_error() -> None:
    """Pure: the judge's load_failed evidence is no CanaryDecision; its fields are shown."""
    failed = pb.RolloutDecision(
        reason="load_failed",
        evidence_json='{"engine":"http://e:8100","error":"checksum mismatch","version":3}',
    )
    assert evidence_line(failed) == "engine http://e:8100; error checksum mismatch; version 3"
    assert evidence_line(pb.RolloutDecision(evidence_json="{not json")) == "evidence unreadable"
    assert evidence_line(pb.RolloutDecision()) == ""  # an operator's: none


async def test_a_decision_that_loses_a_race_lands_refused_and_exits_1(
    broker: EmbeddedBroker, tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race is staged: the judge's promotion of candidate 3 is published between the
    command's check and its own publication, so the operator's rollback of 3 lands on a
    state where 3 is stable and the candidate is gone."""
    from harnessrl.apps.cli import policy as policy_cli

    await publish_all(broker, tmp_path, history())
    publish = policy_cli._publish

    async def judge_first(config: Any, decision: pb.RolloutDecision, timeout: float) -> None:
        promote = pb.RolloutDecision(
            decision_id="canary/3/promote",
            action=pb.ROLLOUT_ACTION_PROMOTE,
            version=3,
            stable=0,
            actor="canary",
            reason="reward",
        )
        await publish_all(broker, tmp_path / "judge", [promote, promote])  # and a copy
        await publish(config, decision, timeout)

    monkeypatch.setattr(policy_cli, "_publish", judge_first)
    code, out, err = await policy(broker, capsys, "rollback", "--by", "alice")
    assert (code, out) == (1, "")
    assert err.strip() == (
        "harnessrl policy rollback: published, but refused where it landed (another decision "
        "came first): stable: the decision was made against version 0, but 3 is stable"
    )
    monkeypatch.setattr(policy_cli, "_publish", publish)
    code, out, _ = await policy(broker, capsys, "status", "--json")
    shown = json.loads(out)
    assert (shown["state"]["stable"], shown["state"]["rolled_back"]) == (3, [1])
    listed = [(d["action"], d["actor"], d["refused"]) for d in shown["decisions"]]
    assert listed == [  # the copy of the promotion is listed once
        ("start", "canary", None),
        ("rollback", "canary", None),
        ("start", "canary", None),
        ("promote", "canary", None),
        (
            "rollback",
            "operator:alice",
            "stable: the decision was made against version 0, but 3 is stable",
        ),
    ]
    code, text, _ = await policy(broker, capsys, "status")
    assert "rollback v3 by operator:alice  REFUSED: stable: the decision was made" in text
