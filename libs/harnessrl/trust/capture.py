"""What the gateway keeps of an engine exchange: pure functions, no I/O.

`take` folds the engine's answer (or each of its stream chunks) into one `Completion` per
choice: the prompt ids the engine saw, the ids it sampled and their log-probs. A stream is
folded by `StreamCapture`, which says whether it may be captured at all: only a stream that
ran to its `[DONE]` with no error event before it (a harness that went away, a generation that
failed or a stream that was cut trains nothing). `model_calls` turns the completions of one
harness call into its ModelCall events, one per choice, with consecutive sequence numbers from
`first_seq`. Whatever dialect the harness spoke, the engine answered in OpenAI's chat or
completions shape, so this is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from harnessrl.episode_token import EpisodeClaims
from harnessrl.v1 import events_pb2 as pb

_MODES = {"train": pb.MODE_TRAIN, "val": pb.MODE_VAL}
FINISH_REASON_CHARS = 64
"""Longest finish reason kept (the engine's free text; a hostile engine cannot bloat calls)."""


@dataclass(slots=True)
class Completion:
    """One choice as the engine produced it, accumulated over a stream if need be."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""


@dataclass(frozen=True, slots=True)
class Exchange:
    """Everything about one answered call that its ModelCalls record, besides the tokens."""

    claims: EpisodeClaims
    api: int
    model: str
    """The model name the harness asked for."""
    stream: bool
    policy_version: int
    engine: str
    temperature: float
    top_p: float
    latency_ms: float
    started_ns: int
    trace_id: str
    span_id: str
    request_body: bytes = b""
    """The harness's body, already capped (empty unless body capture is on)."""
    response_body: bytes = b""
    bodies_truncated: bool = False
    constrained: str = ""
    """How a train call's decoding was constrained (contract.constrained), "" if not."""
    response_id: str = ""
    """The id the harness received for the answer (what feedback names)."""


def take(data: dict[str, Any], chat: bool, completions: dict[int, Completion]) -> None:
    """Fold an engine response (or one stream chunk) into `completions`, by choice index;
    `chat` tells the chat-completions shape from the completions one."""
    top_prompt = data.get("prompt_token_ids")
    for choice in data.get("choices") or ():
        index = choice.get("index", 0)
        completion = completions.get(index)
        if completion is None:
            completion = completions[index] = Completion()
        prompt = choice.get("prompt_token_ids") or top_prompt
        if prompt and not completion.prompt_ids:
            completion.prompt_ids = prompt
        if ids := choice.get("token_ids"):
            completion.ids += ids
        if logprobs := choice.get("logprobs"):  # a stream's chunk holds one token, mostly
            if chat:
                completion.logprobs += [e["logprob"] for e in logprobs.get("content") or ()]
            else:
                completion.logprobs += logprobs.get("token_logprobs") or ()
        if choice.get("finish_reason"):
            completion.finish_reason = str(choice["finish_reason"])[:FINISH_REASON_CHARS]
    if top_prompt:  # a first stream chunk may carry the prompt before any choice token
        for completion in completions.values():
            completion.prompt_ids = completion.prompt_ids or top_prompt


def model_calls(
    exchange: Exchange, completions: dict[int, Completion], first_seq: int
) -> list[pb.ModelCall]:
    """The ModelCall of each choice, in choice order, numbered from `first_seq`."""
    claims = exchange.claims
    calls = []
    for seq, index in enumerate(sorted(completions), start=first_seq):
        completion = completions[index]
        call = pb.ModelCall(
            episode_id=claims.episode_id,
            attempt=claims.attempt,
            group_id=claims.group_id,
            seq=seq,
            mode=_MODES[claims.mode],
            api=exchange.api,  # type: ignore[arg-type]  # a pb.Api value
            model=exchange.model,
            prompt_token_ids=completion.prompt_ids,
            completion_token_ids=completion.ids,
            completion_logprobs=completion.logprobs,
            policy_version=exchange.policy_version,
            finish_reason=completion.finish_reason,
            latency_ms=exchange.latency_ms,
            stream=exchange.stream,
            trace_id=exchange.trace_id,
            span_id=exchange.span_id,
            engine=exchange.engine,
            temperature=exchange.temperature,
            top_p=exchange.top_p,
            request_body=exchange.request_body,
            response_body=exchange.response_body,
            bodies_truncated=exchange.bodies_truncated,
            constrained=exchange.constrained,
            gateway=claims.gateway,
            response_id=exchange.response_id,
        )
        call.started_at.FromNanoseconds(exchange.started_ns)
        calls.append(call)
    return calls


def aligned(completions: dict[int, Completion]) -> bool:
    """Whether every choice has one log-prob per token id (an engine bug otherwise)."""
    return all(len(c.logprobs) == len(c.ids) for c in completions.values())


class StreamCapture:
    """One engine stream, folded event by event as the gateway relays it."""

    __slots__ = ("chat", "completions", "done", "failed")

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.completions: dict[int, Completion] = {}
        self.done = False
        """The engine sent `[DONE]`."""
        self.failed = False
        """The engine sent an error event (the stream is over: nothing after it counts)."""

    def event(self, payload: bytes) -> dict[str, Any] | None:
        """Fold one SSE payload: its parsed event (an error event too, which sets `failed`),
        or None for the closing `[DONE]`. Raises for a payload that is not JSON."""
        if self.done or self.failed:
            raise ValueError("the engine's stream is over; nothing after its end is captured")
        if payload[:1] != b"{" and payload.strip() == b"[DONE]":
            self.done = True
            return None
        chunk: dict[str, Any] = orjson.loads(payload)
        if "error" in chunk or chunk.get("object") == "error":
            self.failed = True
        else:
            take(chunk, self.chat, self.completions)
        return chunk

    @property
    def finished(self) -> bool:
        """Whether the stream may be captured: it ran to its `[DONE]` without an error."""
        return self.done and not self.failed
