"""Fitting a call's completion budget (`max_tokens`) to the room its prompt leaves.

Harnesses ask for the model's largest output whatever the prompt (Claude Code sends
`max_tokens: 64000`; the Agents SDK and Codex often send none); an engine refuses a prompt
plus budget over its context. By default (`gateway.max_tokens_policy: clamp`) the gateway
lowers the budget to the room left, counted in `harnessrl_gateway_max_tokens_clamped`;
`reject` answers 400 naming the field instead. A prompt that alone fills the context is a
400 either way, with both numbers, in Anthropic's words ("prompt is too long: N tokens > M
maximum"), which harnesses such as Claude Code read to compact their context.

Counting a prompt costs an engine round trip (`POST /tokenize`, with the same messages,
tools and template settings, so the count is the engine's own), so it is done only when the
call could overflow: a prompt has at most as many tokens as its text has bytes (every token
of a byte-level or byte-fallback tokenizer stands for at least one byte) plus what the chat
template adds, for which `TEMPLATE_MARGIN` is allowed. A call whose encoded body, margin and
budget fit the context goes straight through.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson

from harnessrl.logs import get_logger
from harnessrl.retry import is_retryable
from harnessrl.services.gateway.engines import EnginePool
from harnessrl.services.gateway.errors import GatewayError
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.trust.contract import TOKENIZE_PATH

log = get_logger(__name__)

TEMPLATE_MARGIN = 1024
"""Tokens a chat template may add beyond the request's own text (role markers, a default
system prompt, the tools preamble)."""
_TEMPLATE_FIELDS = (
    "messages",
    "tools",
    "tool_choice",  # "none" leaves the tools out of the prompt
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "documents",
)


class Budget:
    """Fits budgets for one gateway. `context` is the engines' context length in tokens
    (0: unknown, budgets left to the engines), None to read it from their /v1/models
    (`max_model_len`) when first needed."""

    def __init__(
        self,
        pool: EnginePool,
        *,
        policy: Literal["clamp", "reject"],
        context: int | None,
        metrics: GatewayMetrics,
    ) -> None:
        self._pool = pool
        self._policy = policy
        self._context = context
        self._metrics = metrics

    async def fit(
        self,
        upstream: dict[str, Any],
        *,
        chat: bool,
        episode_id: str,
        budget_field: str,
        prompt_field: str,
    ) -> bytes:
        """The encoded engine request, its budget lowered to the room left when it would
        overflow the context (modifying `upstream`). Raises GatewayError(400) for a prompt
        that fills the context, or (policy reject) a budget that overflows it."""
        encoded = orjson.dumps(upstream)
        keys = [k for k in ("max_completion_tokens", "max_tokens") if _count(upstream.get(k))]
        asked = min((upstream[k] for k in keys), default=None)
        if self._context is None:
            self._context = await self._discover()
        context = self._context
        if not context:
            return encoded
        if len(encoded) + TEMPLATE_MARGIN + (asked or 0) <= context:
            return encoded
        prompt = await self.prompt_tokens(upstream, chat, episode_id)
        if prompt is None:
            return encoded
        if prompt >= context:
            raise GatewayError(
                400,
                f"prompt is too long: {prompt} tokens > {context - 1} maximum ({prompt_field}: "
                f"the prompt alone fills the model's {context}-token context)",
                prompt_field,
                code="context_length_exceeded",
            )
        room = context - prompt
        if asked is None or asked <= room:
            return encoded
        if self._policy == "reject":
            raise GatewayError(
                400,
                f"{budget_field}: {asked} tokens do not fit: the prompt is {prompt} tokens of the "
                f"model's {context}-token context, which leaves {room}",
                budget_field,
                code="context_length_exceeded",
            )
        for key in keys:
            upstream[key] = min(upstream[key], room)
        self._metrics.clamped.inc()
        return orjson.dumps(upstream)

    async def prompt_tokens(
        self, upstream: dict[str, Any], chat: bool, episode_id: str
    ) -> int | None:
        """The prompt's length as the engine counts it; None when it cannot tell (an engine
        without /tokenize, or a batch of completion prompts)."""
        if chat:
            request = {k: upstream[k] for k in _TEMPLATE_FIELDS if k in upstream}
        else:
            prompt = upstream.get("prompt")
            if isinstance(prompt, list) and all(_count(t) or t == 0 for t in prompt):
                return len(prompt)
            if not isinstance(prompt, str):
                return None
            request = {"prompt": prompt}
        request["model"] = upstream["model"]
        _, response = await self._pool.request(episode_id, TOKENIZE_PATH, orjson.dumps(request))
        if response.status != 200:  # the engine's own answer to the call will say why
            if response.status == 404:
                log.warning("the engine serves no /tokenize: budgets are left to it")
            return None
        count = orjson.loads(response.body).get("count")
        return count if _count(count) else None

    async def _discover(self) -> int | None:
        """The engines' context from their model list: 0 when they do not say (budgets are
        then left to them), None when they could not be asked now (asked again next time)."""
        try:
            response = await self._pool.get("/v1/models")
        except Exception as err:
            if not is_retryable(err):
                raise
            return None
        if response.status != 200:
            return None
        return context_of(response.body)


def context_of(models: bytes) -> int:
    """The context length a /v1/models answer gives (vLLM's `max_model_len`), 0 if none."""
    try:
        listing = orjson.loads(models)
    except orjson.JSONDecodeError:
        return 0
    data = (listing.get("data") if isinstance(listing, dict) else None) or [{}]
    context = data[0].get("max_model_len") if isinstance(data[0], dict) else None
    return context if isinstance(context, int) and _count(context) else 0


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
