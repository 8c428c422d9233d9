"""What every dialect is: one wire format a harness speaks, translated to and from the engine.

A dialect parses the harness's request body into an `EngineCall` (the engine request in
OpenAI's chat or completions shape, and a `Renderer` that writes the engine's answer back in
the harness's format) and says how its errors look. The call lifecycle
(services/gateway/lifecycle.py) does the rest, the same for every dialect: admission,
forwarding, capture, outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from harnessrl.episode_token import EpisodeClaims
from harnessrl.services.gateway.errors import ErrorShape


class StreamRenderer(Protocol):
    """Writes one engine stream as the harness's stream. Not reused across calls."""

    def feed(self, chunk: dict[str, Any]) -> bytes:
        """The bytes one engine chunk (parsed, not an error) becomes; b"" for none."""

    def fail(self, error: dict[str, Any]) -> bytes:
        """The bytes an engine error event becomes; the stream is over after it."""

    def finish(self) -> bytes:
        """The closing bytes, once the engine's stream ended with its `[DONE]`."""


class Renderer(Protocol):
    """Writes the engine's answer to one call in the harness's format."""

    def body(self, data: dict[str, Any]) -> Any:
        """The JSON answer for the engine's 200 answer `data` (parsed; may be modified)."""

    def stream(self) -> StreamRenderer:
        """A renderer for the engine's stream."""

    def response_id(self, engine_id: str) -> str:
        """The id the harness is given for the answer the engine gave as `engine_id` (what
        feedback about this response names)."""


@dataclass(slots=True)
class EngineCall:
    """One harness request, translated for the engine."""

    path: str
    """The engine route: contract.CHAT_PATH or contract.COMPLETIONS_PATH."""
    body: dict[str, Any]
    """The engine request as a harness would send it; the lifecycle applies the inference
    contract on top (libs/harnessrl/trust/contract.py) and may lower the completion budget."""
    stream: bool
    """Whether the harness asked for a stream."""
    model: str
    """The model name the harness asked for (its answers carry it back)."""
    renderer: Renderer
    budget_field: str = "max_tokens"
    """The harness's name for the completion budget (named in errors)."""
    prompt_field: str = "messages"
    """The harness's name for what makes the prompt (named in errors)."""


class Dialect(Protocol):
    """One wire format: `kind` labels its metrics and spans, `api` its ModelCalls."""

    kind: str
    api: int
    errors: ErrorShape

    def translate(self, body: dict[str, Any], claims: EpisodeClaims) -> EngineCall:
        """The engine call for a harness request body (a parsed JSON object). Raises
        GatewayError naming the field for a request it refuses."""
