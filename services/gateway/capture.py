"""What the gateway asks the engine for, and what it keeps of the answer.

The engine is asked for exact token ids and log-probs (vLLM's `return_token_ids` and
`logprobs`, never `include_reasoning: false`, which drops ids in vLLM). From its answer the
gateway keeps, per choice, the prompt and completion ids and the completion log-probs
(`Completion`), and hands the harness the answer it would have had from the API: vLLM's
extra fields removed unless the harness asked for them, its own model name restored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harnessrl.services.gateway.config import SamplingOverrides

CHAT, COMPLETIONS = "chat", "completions"
_EXTRA_TOP = ("prompt_token_ids", "prompt_logprobs", "kv_transfer_params")


@dataclass(slots=True)
class Completion:
    """One choice as the engine produced it, accumulated over a stream if need be."""

    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""


@dataclass(frozen=True, slots=True)
class Asked:
    """What the harness asked for that changes the answer it gets."""

    model: str
    token_ids: bool
    logprobs: bool
    stream: bool


class InvalidRequest(ValueError):
    """A harness request the gateway refuses (400) before the engine sees it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


def check_request(body: dict[str, Any], kind: str) -> None:
    """Refuse what the gateway itself reads, when it is not of its type: the engine's own
    parser is lenient (`"stream": "yes"` streams), and the gateway must read these fields as
    the engine does. Everything else is the engine's to validate. Raises InvalidRequest."""
    if not isinstance(body.get("model"), str):
        raise InvalidRequest("model", "required, a string")
    for name in ("stream", "return_token_ids"):
        if not isinstance(body.get(name, False), bool):
            raise InvalidRequest(name, "must be a boolean")
    logprobs = body.get("logprobs")
    if kind == CHAT and not isinstance(logprobs, bool | None):
        raise InvalidRequest("logprobs", "must be a boolean")
    if kind == COMPLETIONS and (not isinstance(logprobs, int | None) or isinstance(logprobs, bool)):
        raise InvalidRequest("logprobs", "must be an integer")


def prepare(
    body: dict[str, Any], kind: str, engine_model: str, overrides: SamplingOverrides
) -> tuple[dict[str, Any], Asked]:
    """The engine request for a harness request body (not modified), and what was asked."""
    asked = Asked(
        model=str(body.get("model", "")),
        token_ids=body.get("return_token_ids") is True,
        logprobs=_asked_logprobs(body, kind),
        stream=body.get("stream") is True,
    )
    upstream = dict(body)
    upstream["model"] = engine_model
    upstream["return_token_ids"] = True
    if kind == CHAT:
        upstream["logprobs"] = True
    elif not asked.logprobs:
        upstream["logprobs"] = 0  # the sampled tokens' log-probs, no alternatives
    upstream.pop("include_reasoning", None)
    if overrides.temperature is not None:
        upstream["temperature"] = overrides.temperature
    if overrides.top_p is not None:
        upstream["top_p"] = overrides.top_p
    for name in overrides.drop:
        upstream.pop(name, None)
    return upstream, asked


def _asked_logprobs(body: dict[str, Any], kind: str) -> bool:
    value = body.get("logprobs")
    if kind == CHAT:
        return value is True
    return isinstance(value, int) and not isinstance(value, bool)


def take(data: dict[str, Any], kind: str, completions: dict[int, Completion]) -> None:
    """Fold an engine response (or one stream chunk) into `completions`, by choice index."""
    top_prompt = data.get("prompt_token_ids")
    for choice in data.get("choices") or ():
        completion = completions.get(choice.get("index", 0))
        if completion is None:
            completion = completions[choice.get("index", 0)] = Completion()
        prompt = choice.get("prompt_token_ids") or top_prompt
        if prompt and not completion.prompt_ids:
            completion.prompt_ids = prompt
        completion.ids.extend(choice.get("token_ids") or ())
        logprobs = choice.get("logprobs")
        if logprobs:
            if kind == CHAT:
                completion.logprobs.extend(e["logprob"] for e in logprobs.get("content") or ())
            else:
                completion.logprobs.extend(logprobs.get("token_logprobs") or ())
        if choice.get("finish_reason"):
            completion.finish_reason = choice["finish_reason"]
    if top_prompt:  # a first stream chunk may carry the prompt before any choice token
        for completion in completions.values():
            completion.prompt_ids = completion.prompt_ids or top_prompt


def for_harness(data: dict[str, Any], asked: Asked) -> dict[str, Any]:
    """The engine's answer (or chunk) as the API would give it: modified in place. An error
    event is passed on in OpenAI's shape (vLLM's older flat one is put in it)."""
    if "error" in data:
        return data
    if data.get("object") == "error":
        keys = ("message", "type", "param", "code")
        return {"error": {k: data.get(k) for k in keys}}
    data["model"] = asked.model or data.get("model")
    if not asked.token_ids:
        for name in _EXTRA_TOP:
            data.pop(name, None)
    for choice in data.get("choices") or ():
        choice.pop("stop_reason", None)
        if not asked.token_ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not asked.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return data
