"""What the gateway asks of any engine (vLLM's OpenAI dialect), whatever the harness spoke.

Every dialect translates its request into an engine request in OpenAI's chat-completions or
completions shape; `engine_request` then applies the inference contract: the engine's model
name, exact token ids and log-probs (vLLM's `return_token_ids` and `logprobs`; never
`include_reasoning: false`, which drops ids in vLLM), and the sampling the episode's mode
forces (train calls sample the policy's own distribution: neutral values sent for every
sampling control, so vLLM cannot fill them from the model's generation config). A train call
whose decoding is constrained (`constrained`) is still served, and marked so on its
ModelCall: its completion is never trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
TOKENIZE_PATH = "/tokenize"
VERSION_HEADER = "x-policy-version"
"""Response header naming the policy version that served a call (the project's engine)."""


class Sampling(Protocol):
    """The sampling forced on calls of one mode (the gateway's `train` and `val` settings)."""

    @property
    def temperature(self) -> float | None:
        """None: keep the harness's own."""

    @property
    def top_p(self) -> float | None:
        """None: keep the harness's own."""

    @property
    def neutral(self) -> Mapping[str, float | int]:
        """Sampling fields sent with these values whatever the harness asked."""

    @property
    def drop(self) -> Sequence[str]:
        """Request fields removed before the engine sees them."""


def engine_request(
    body: dict[str, Any], path: str, engine_model: str, overrides: Sampling
) -> dict[str, Any]:
    """The engine request for a translated request `body` (not modified)."""
    upstream = dict(body)
    upstream["model"] = engine_model
    upstream["return_token_ids"] = True
    if path == CHAT_PATH:
        upstream["logprobs"] = True
    elif not _int(body.get("logprobs")):
        upstream["logprobs"] = 0  # the sampled tokens' log-probs, no alternatives
    upstream.pop("include_reasoning", None)
    if overrides.temperature is not None:
        upstream["temperature"] = overrides.temperature
    if overrides.top_p is not None:
        upstream["top_p"] = overrides.top_p
    upstream.update(overrides.neutral)
    for name in overrides.drop:
        upstream.pop(name, None)
    return upstream


_GUIDED = (
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
)


def constrained(body: dict[str, Any]) -> str:
    """How an engine request constrains sampling beyond the model's distribution ("": it
    does not): a JSON response format, vLLM's guided decoding, or a tool choice that forces
    a tool (vLLM decodes those as structured outputs)."""
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        return "response_format"
    if any(body.get(name) is not None for name in _GUIDED):
        return "guided_decoding"
    tool_choice = body.get("tool_choice")
    if body.get("tools") and (tool_choice == "required" or isinstance(tool_choice, dict)):
        return "tool_choice"
    return ""


def policy_version(header: str | None, loaded: int) -> int:
    """The version that served a call: the engine's own word (`x-policy-version`) wins,
    else what it had loaded when the call was sent."""
    return int(header) if header and header.isdigit() else loaded


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
