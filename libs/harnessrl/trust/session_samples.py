"""A ready production session (a group of one episode) becomes GroupSamples, deterministically.

A session has no siblings to be compared with, so its advantage comes from the running
baselines of its app and kind (session_baseline.py), and feedback about single responses
credits those turns on top (feedback.py). The rule, for a session of app `a` and kind `k`
whose reward R was decided:

- not explored (served as the app asked, MODE_VAL): nothing is trained, every captured token
  is dropped as `not_explored`, and the baselines do not learn R (its calls were not
  sampled from the policy's own distribution);
- not trainable (incomplete, invalid, flagged, reward missing, too long, ...): every token
  dropped with that reason, exactly as samples.py drops an episode; a missing reward is
  always `reward_missing` (a session is never filled with a made-up reward); no baseline
  learns anything;
- otherwise its calls are merged as samples.py merges an episode (same books, truncation,
  constrained calls), and

      A   = baselines.advantage(session_keys(a, k), R)                 the session's
      A_t = A + baselines.advantage(session_keys(a, k, "turn"), r_t)   turn t's

  where r_t is the reward feedback gave response t alone (`session_reward(...).turns`,
  taken in response-id order). Every sample carries `advantage = A`; a sample holding the
  completion of a call whose `response_id` is a credited turn also carries `advantages`, one
  per token: A_t on that call's completion tokens, A on the sample's other loss-mask tokens,
  0 off the mask. A turn that no call of the session answered (or whose reward is not a
  finite number) is counted (`SessionBuilt.unmatched_turns`), never credited and never
  learnt by a baseline.

The baselines are read and then advanced in that order (the session, then its credited
turns), once per build: the caller keeps the advanced state only when it keeps the result.
Nothing here reads a clock or a random source: the same session and baselines give the same
bytes and the same baseline state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from harnessrl.trust.feedback import FeedbackRules, Signal, session_reward
from harnessrl.trust.group import Group, GroupEpisode
from harnessrl.trust.merging import Segment
from harnessrl.trust.samples import (
    Built,
    Decode,
    KeptEpisode,
    Rules,
    close_books,
    drop_episode,
    fill_sample,
    merge_episode,
    verdict,
)
from harnessrl.trust.session_baseline import Baselines, session_keys
from harnessrl.v1 import events_pb2 as pb

ESTIMATOR = "session_baseline"
"""GroupSamples.estimator of a session's samples."""
NOT_EXPLORED = "not_explored"
REWARD_MISSING = "reward_missing"


@dataclass(slots=True)
class SessionBuilt:
    """The outcome of building one session."""

    built: Built
    """As for a controller's group; `built.dropped` names why nothing is trained."""
    advantage: float | None = None
    """A, when the session is trained."""
    turns: dict[str, float] = field(default_factory=dict)
    """Credited response id -> A_t."""
    unmatched_turns: int = 0
    """Turns feedback named that no call of the session answered."""
    kind: str = ""


def build_session(
    group: Group,
    settings: Rules,
    baselines: Baselines,
    feedback: FeedbackRules,
    *,
    app: str,
    expired: bool = False,
    unfinished: Sequence[pb.ModelCall] = (),
    decode: Decode | None = None,
) -> SessionBuilt:
    """The samples of session `group` (app `app`), advancing `baselines` when it is trained
    (see the module docstring). `expired`: the session waited past its retention and is
    built from what arrived (dropped: `reward_missing` when only its reward is missing,
    else `incomplete:<what>`); `unfinished` are the calls it holds when no EpisodeFinished
    arrived (not an episode of the group yet: their tokens are dropped as incomplete). A
    group of several episodes is no session: each is dropped as `invalid`."""
    episodes = group.episodes()
    built = Built(samples=None)
    if len(episodes) > 1:
        for episode in episodes:
            _drop(built, episode, "invalid:episodes")
        return SessionBuilt(built)
    if not episodes:  # it never finished: only calls arrived before it expired
        return SessionBuilt(_drop_unfinished(built, unfinished))
    (episode,) = episodes
    session = _session_info(episode)
    out = SessionBuilt(built, kind=session.kind if session is not None else "")
    reward = episode.state.reward
    reason = _reason(group, episode, settings, session, expired)
    if reason == NOT_EXPLORED and reward is not None and not reward.missing:
        built.rewards.append(reward.value)  # measured, as a val group's rewards are
    if reason is not None:
        _drop(built, episode, reason)
        return out
    assert reward is not None  # _reason says it is there
    built.rewards.append(reward.value)
    kept: list[KeptEpisode] = []
    failed = merge_episode(
        episode, reward.value, settings=settings, decode=decode, built=built, kept=kept
    )
    if failed is not None:
        _drop(built, episode, failed)
        return out
    close_books(built, kept, None)
    out.advantage = baselines.advantage(session_keys(app, out.kind), reward.value)
    _credit(out, episode, reward, baselines=baselines, feedback=feedback, app=app)
    built.samples = samples = pb.GroupSamples(
        group_id=group.group_id,
        task_id=group.task_id,
        merge=built.merge,
        dropped=built.episodes_dropped,
        estimator=ESTIMATOR,
        books=built.books,
    )
    calls = _copies_by_seq(episode)
    (k,) = kept
    for index, segment in enumerate(k.segments):
        sample = samples.samples.add()
        fill_sample(sample, k, index, segment, out.advantage)
        per_token = _per_token(segment, calls, out.advantage, out.turns)
        if per_token is not None:
            sample.advantages.extend(per_token.tolist())
    return out


def _credit(
    out: SessionBuilt,
    episode: GroupEpisode,
    reward: pb.RewardAssigned,
    *,
    baselines: Baselines,
    feedback: FeedbackRules,
    app: str,
) -> None:
    """`out.turns`: A_t of each turn feedback credited that a call answered, in response-id
    order (each advancing the turn baseline once); the others counted as unmatched."""
    assert out.advantage is not None
    credit = session_reward([_signal(s) for s in reward.signals], feedback).turns
    answered = {c.response_id for c in episode.every_call if c.response_id}
    for response_id, value in credit.items():  # sorted by response id
        if response_id not in answered or not math.isfinite(value):
            out.unmatched_turns += 1
            continue
        turn = baselines.advantage(session_keys(app, out.kind, "turn"), value)
        out.turns[response_id] = out.advantage + turn


def _reason(
    group: Group,
    episode: GroupEpisode,
    settings: Rules,
    session: pb.SessionInfo | None,
    expired: bool,
) -> str | None:
    """Why the session is not trained, or None."""
    if group.mode != pb.MODE_TRAIN or (session is not None and not session.explored):
        return NOT_EXPLORED
    waiting = episode.state.missing()
    if waiting == "reward" and expired:
        return REWARD_MISSING
    reason, _ = verdict(episode, settings)
    if reason is None and episode.state.reward is not None and episode.state.reward.missing:
        return REWARD_MISSING  # never filled: a session has no made-up reward
    return reason


def _drop(built: Built, episode: GroupEpisode, reason: str) -> None:
    """The whole session dropped for `reason` (books, and its DroppedEpisode)."""
    name = reason.partition(":")[0]
    drop_episode(built, episode, name)
    if reason != NOT_EXPLORED:
        built.episodes_dropped.append(
            pb.DroppedEpisode(
                episode_id=episode.episode_id,
                attempt=episode.attempt,
                reason=reason,
                calls=len(episode.state.calls),
            )
        )
    built.dropped = name
    close_books(built, [], None)


def _drop_unfinished(built: Built, calls: Sequence[pb.ModelCall]) -> Built:
    """A session that never finished: the tokens of its calls (each distinct copy) dropped
    as incomplete."""
    built.dropped = "incomplete"
    distinct = {c.SerializeToString(deterministic=True): c for c in calls}
    tokens = sum(len(c.completion_token_ids) for c in distinct.values())
    built.books.captured += tokens
    built.dropped_tokens["incomplete"] += tokens
    close_books(built, [], None)
    return built


def _session_info(episode: GroupEpisode) -> pb.SessionInfo | None:
    """The session as the gateway's EpisodeFinished (else the reward service) named it."""
    state = episode.state
    if state.finished is not None and state.finished.HasField("session"):
        return state.finished.session
    if state.reward is not None and state.reward.HasField("session"):
        return state.reward.session
    return None


def _signal(s: pb.FeedbackSignal) -> Signal:
    received = s.received_at.seconds + s.received_at.nanos / 1e9
    return Signal(s.name, s.value, s.response_id, s.idempotency_key, received)


def _copies_by_seq(episode: GroupEpisode) -> dict[int, list[pb.ModelCall]]:
    out: dict[int, list[pb.ModelCall]] = {}
    for call in episode.calls:
        out.setdefault(call.seq, []).append(call)
    return out


def _per_token(
    segment: Segment,
    calls: Mapping[int, Sequence[pb.ModelCall]],
    advantage: float,
    turns: Mapping[str, float],
) -> npt.NDArray[np.float32] | None:
    """float32 [T]: A on the mask, A_t on the completion of a credited call, 0 off the mask;
    None when no call of the segment is credited."""
    if not turns:
        return None
    mask = segment.loss_mask  # bool [T]
    out: npt.NDArray[np.float32] | None = None
    for seq in segment.call_seqs:
        call = _used_copy(segment, calls.get(seq, ()))
        if call is None or call.response_id not in turns:
            continue
        if out is None:
            out = np.where(mask, np.float32(advantage), np.float32(0.0))  # float32 [T]
        start = len(call.prompt_token_ids)
        end = min(start + len(call.completion_token_ids), len(mask))
        if start < end:
            span = mask[start:end]  # bool [end - start]
            out[start:end] = np.where(span, np.float32(turns[call.response_id]), out[start:end])
    return out


def _used_copy(segment: Segment, copies: Sequence[pb.ModelCall]) -> pb.ModelCall | None:
    """The copy of a seq the segment holds (of conflicting copies, the one whose completion
    is where the segment has it)."""
    if len(copies) <= 1:
        return copies[0] if copies else None
    ids = segment.token_ids
    for call in copies:
        start = len(call.prompt_token_ids)
        completion = np.array(call.completion_token_ids, dtype=ids.dtype)
        held = ids[start : start + len(completion)]
        if len(held) and np.array_equal(held, completion[: len(held)]):
            return call
    return None
