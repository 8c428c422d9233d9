"""A production session becomes samples (trust/session_samples.py), and its per-token
advantages reach the trainer's micro-batches (trust/packing.py). The sample builder's store
of sessions is tested in test_session_store.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf.message import Message

from harnessrl.production import ProductionSection
from harnessrl.services.sample_builder.config import SampleBuilderSection
from harnessrl.trust.group import Group
from harnessrl.trust.packing import SampleArrays, normalization_weights, pack
from harnessrl.trust.session_baseline import Baselines, session_keys
from harnessrl.trust.session_samples import SessionBuilt, build_session
from harnessrl.v1 import events_pb2 as pb

GROUP = "s.desk.chat-1"
FEEDBACK = ProductionSection().feedback


def info(*, explored: bool = True, ended_by: str = "") -> pb.SessionInfo:
    return pb.SessionInfo(
        app="desk", session_id="chat-1", kind="support", explored=explored, ended_by=ended_by
    )


def session_events(
    *,
    calls: int = 3,
    explored: bool = True,
    reward: float | None = 1.0,
    signals: tuple[tuple[str, float, str], ...] = (("thumbs", 1.0, ""),),
    group: str = GROUP,
) -> list[tuple[str, Message]]:
    """What the gateway and the reward service publish for one session: calls extending one
    conversation (response ids resp-0, resp-1, ...), the close, started and finished, and
    (unless `reward` is None) the reward with its feedback `signals` (name, value, response)."""
    mode = pb.MODE_TRAIN if explored else pb.MODE_VAL
    out: list[tuple[str, Message]] = [
        (
            "episode_started",
            pb.EpisodeStarted(
                episode_id=group, attempt=1, group_id=group, index=0, group_size=1, mode=mode,
                runner="session", session=info(explored=explored),
            ),
        )
    ]  # fmt: skip
    prompt = [7, 8, 9, 10]
    for seq in range(calls):
        completion = [100 + 10 * seq + i for i in range(3 + seq)]
        call = pb.ModelCall(
            episode_id=group, attempt=1, group_id=group, seq=seq, mode=mode,
            prompt_token_ids=prompt, completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion), temperature=1.0, policy_version=2,
            response_id=f"resp-{seq}", span_id=f"{seq + 1:016x}", trace_id=f"{1:032x}",
        )  # fmt: skip
        out.append(("model_call", call))
        prompt = prompt + completion + [1, 2]  # the app's next turn
    closed = pb.EpisodeClosed(episode_id=group, attempt=1, group_id=group, call_count=calls)
    out.append(("episode_closed", closed))
    out.append(
        (
            "episode_finished",
            pb.EpisodeFinished(
                episode_id=group, attempt=1, group_id=group, mode=mode, final=True,
                status=pb.EPISODE_STATUS_SUCCEEDED, session=info(explored=explored, ended_by="end"),
            ),
        )
    )  # fmt: skip
    if reward is not None:
        out.append(("reward_assigned", reward_event(reward, signals, group=group)))
    return out


def reward_event(
    value: float, signals: tuple[tuple[str, float, str], ...], *, group: str = GROUP
) -> pb.RewardAssigned:
    event = pb.RewardAssigned(
        episode_id=group, attempt=1, group_id=group, value=value, source="feedback",
        session=info(),
    )  # fmt: skip
    for i, (name, v, response_id) in enumerate(signals):
        signal = event.signals.add(name=name, value=v, response_id=response_id)
        signal.idempotency_key = f"k{i}"
        signal.received_at.FromSeconds(1_000 + i)
    if not signals:
        event.missing = True
    return event


def group_of(items: list[tuple[str, Message]]) -> Group:
    group = Group(GROUP, 0.0)
    for kind, event in items:
        group.add(kind, event)
    return group


def baselines() -> Baselines:
    return Baselines(halflife=200.0, min_count=1)


def built_of(
    items: list[tuple[str, Message]], state: Baselines | None = None, **settings: object
) -> SessionBuilt:
    return build_session(
        group_of(items),
        SampleBuilderSection(**settings),  # type: ignore[arg-type]
        state if state is not None else baselines(),
        FEEDBACK,
        app="desk",
    )


def captured(items: list[tuple[str, Message]]) -> int:
    return sum(len(e.completion_token_ids) for _, e in items if isinstance(e, pb.ModelCall))


def balanced(books: pb.TokenBooks) -> bool:
    return books.captured == books.trained + sum(books.dropped.values())


# -- building ------------------------------------------------------------------------------


def test_a_trained_session_balances_its_books_and_carries_the_session_advantage() -> None:
    items = session_events(calls=3)
    # A retry of the last call (same prompt, other answer): the retried call is dropped.
    retry = pb.ModelCall()
    retry.CopyFrom(items[3][1])  # type: ignore[arg-type]
    retry.seq, retry.response_id, retry.span_id = 3, "resp-retry", f"{99:016x}"
    retry.completion_token_ids[:] = [5, 5]
    retry.completion_logprobs[:] = [-1.0, -1.0]
    items.insert(4, ("model_call", retry))
    items[5][1].call_count = 4  # type: ignore[attr-defined]
    state = baselines()
    state.advantage(session_keys("desk", "support"), 0.25)  # an earlier session
    result = built_of(items, state)
    samples = result.built.samples
    assert samples is not None and samples.estimator == "session_baseline"
    books = samples.books
    assert books.captured == captured(items) and balanced(books)
    assert dict(books.dropped) == {"retried": 5}
    assert result.advantage == pytest.approx(1.0 - 0.25)
    for sample in samples.samples:
        assert sample.advantage == pytest.approx(0.75) and sample.reward == 1.0
        assert len(sample.advantages) == 0  # no turn credited: `advantage` everywhere


def test_an_unexplored_session_drops_every_token_as_not_explored() -> None:
    items = session_events(explored=False)
    state = baselines()
    result = built_of(items, state)
    built = result.built
    assert built.samples is None and built.dropped == "not_explored"
    assert dict(built.books.dropped) == {"not_explored": captured(items)}
    assert built.books.captured == captured(items) and built.books.trained == 0
    assert built.rewards == [1.0]  # measured, never trained
    assert len(state) == 0  # the baselines learnt nothing from it


def test_a_missing_reward_drops_the_session_as_reward_missing_even_when_filling() -> None:
    items = session_events(signals=())
    state = baselines()
    result = built_of(items, state, missing_reward="fill")
    assert result.built.samples is None and result.built.dropped == "reward_missing"
    assert dict(result.built.books.dropped) == {"reward_missing": captured(items)}
    assert [d.reason for d in result.built.episodes_dropped] == ["reward_missing"]
    assert len(state) == 0


def test_an_expired_session_is_reward_missing_or_incomplete_by_what_it_lacks() -> None:
    unrewarded = session_events(reward=None)
    build = build_session(
        group_of(unrewarded), SampleBuilderSection(), baselines(), FEEDBACK, app="desk",
        expired=True,
    )  # fmt: skip
    assert build.built.dropped == "reward_missing"
    assert dict(build.built.books.dropped) == {"reward_missing": captured(unrewarded)}
    unclosed = [i for i in session_events() if i[0] != "episode_closed"]
    build = build_session(
        group_of(unclosed), SampleBuilderSection(), baselines(), FEEDBACK, app="desk",
        expired=True,
    )  # fmt: skip
    assert build.built.dropped == "incomplete"
    assert [d.reason for d in build.built.episodes_dropped] == ["incomplete:closed"]
    unfinished = [i for i in session_events(reward=None) if i[0] != "episode_finished"]
    calls = [e for _, e in unfinished if isinstance(e, pb.ModelCall)]
    build = build_session(
        group_of(unfinished), SampleBuilderSection(), baselines(), FEEDBACK, app="desk",
        expired=True, unfinished=calls,
    )  # fmt: skip
    assert dict(build.built.books.dropped) == {"incomplete": captured(unfinished)}
    assert balanced(build.built.books)


def test_a_credited_turn_lands_on_its_calls_completion_tokens_only() -> None:
    signals = (("thumbs", 1.0, ""), ("thumbs", -1.0, "resp-1"), ("thumbs", 1.0, "resp-gone"))
    items = session_events(calls=3, reward=1.0, signals=signals)
    state = baselines()
    state.advantage(session_keys("desk", "support", "turn"), 0.5)  # an earlier turn's reward
    result = built_of(items, state)
    assert result.advantage == pytest.approx(1.0)  # no session reward before it: m = 0
    assert result.turns == {"resp-1": pytest.approx(1.0 + (-1.0 - 0.5))}
    assert result.unmatched_turns == 1
    samples = result.built.samples
    assert samples is not None
    (sample,) = samples.samples  # one conversation: one chain
    calls = {e.seq: e for _, e in items if isinstance(e, pb.ModelCall)}
    mask = np.array(sample.loss_mask)
    per_token = np.array(sample.advantages, dtype=np.float32)
    assert per_token.shape == mask.shape
    start = len(calls[1].prompt_token_ids)
    credited = np.zeros_like(mask)
    credited[start : start + len(calls[1].completion_token_ids)] = True
    assert np.all(per_token[~mask] == 0)
    assert np.allclose(per_token[credited], np.float32(-0.5))
    assert np.allclose(per_token[mask & ~credited], np.float32(1.0))
    assert int(credited.sum()) == len(calls[1].completion_token_ids)
    assert sample.advantage == pytest.approx(1.0)


def test_the_same_session_and_baselines_give_the_same_bytes_and_state() -> None:
    signals = (("thumbs", 0.5, ""), ("thumbs", 1.0, "resp-0"))
    outcomes = []
    for _ in range(2):
        state = baselines()
        state.load(b'[[["desk","support",""],3,0.2,0.1]]')
        result = built_of(session_events(signals=signals, reward=0.5), state)
        assert result.built.samples is not None
        outcomes.append(
            (result.built.samples.SerializeToString(deterministic=True), state.to_bytes())
        )
    assert outcomes[0] == outcomes[1]


def test_a_build_advances_each_baseline_once() -> None:
    state = baselines()
    signals = (("thumbs", 1.0, ""), ("thumbs", 1.0, "resp-0"), ("thumbs", 0.0, "resp-2"))
    built_of(session_events(signals=signals), state)
    session = state.estimate(session_keys("desk", "support"))
    turn = state.estimate(session_keys("desk", "support", "turn"))
    assert session is not None and session.count == 1 and session.mean == 1.0
    assert turn is not None and turn.count == 2  # two credited turns, each once
    assert state.estimate([("desk", "", "")]) is not None  # the app's key learns it too


# -- packing ------------------------------------------------------------------------------


def test_packing_uses_per_token_advantages_when_a_sample_has_them() -> None:
    sample = pb.Sample(
        sample_id="s/1/0", episode_id="s", token_ids=[1, 2, 3, 4], temperature=1.0,
        loss_mask=[False, True, True, False], behavior_logprobs=[0.0, -0.5, -0.5, 0.0],
        advantage=0.5, advantages=[9.0, 0.5, -1.5, 9.0],
    )  # fmt: skip
    plain = pb.Sample()
    plain.CopyFrom(sample)
    plain.sample_id = "s/1/1"
    del plain.advantages[:]
    arrays = [SampleArrays.from_proto(sample), SampleArrays.from_proto(plain)]
    weights = normalization_weights(arrays, "token_mean", constant_tokens=1)
    (batch,) = pack(arrays, weights, micro_batch_tokens=64)
    rows = dict(zip(batch.sample_ids, batch.advantages, strict=True))
    assert torch.equal(rows["s/1/0"], torch.tensor([0.0, 0.5, -1.5, 0.0]))  # 0 off the mask
    assert torch.equal(rows["s/1/1"], torch.tensor([0.5] * 4))


@pytest.mark.parametrize(
    ("advantages", "message"),
    [([0.5, 0.5], r"advantages \(2\).*token_ids \(4\)"), ([0, float("nan"), 0, 0], "advantages")],
)
def test_packing_refuses_per_token_advantages_of_another_length_or_not_finite(
    advantages: list[float], message: str
) -> None:
    sample = pb.Sample(
        sample_id="s/1/0", token_ids=[1, 2, 3, 4], temperature=1.0,
        loss_mask=[False, True, True, False], behavior_logprobs=[0.0, -0.5, -0.5, 0.0],
        advantages=advantages,
    )  # fmt: skip
    with pytest.raises(ValueError, match=message):
        SampleArrays.from_proto(sample)


def test_a_session_group_of_two_episodes_is_dropped_as_invalid() -> None:
    items = session_events()
    other = [(k, e) for k, e in session_events(group=GROUP) if k != "episode_started"]
    for _, event in other:
        event.episode_id = f"{GROUP}-other"  # type: ignore[attr-defined]
    state = baselines()
    result = built_of([*items, *other], state)
    built = result.built
    assert built.samples is None and built.dropped == "invalid"
    assert dict(built.books.dropped) == {"invalid": 2 * captured(items)} and balanced(built.books)
    assert len(state) == 0
