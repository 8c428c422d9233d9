"""`POST /v1/chat/completions`: OpenAI's chat completions, which the engine speaks itself.

The gateway checks only the fields it reads (model, stream, return_token_ids, logprobs);
everything else is the engine's to validate, and its 400 comes back as it is.
"""

from __future__ import annotations

from typing import Any

from harnessrl.episode_token import EpisodeClaims
from harnessrl.services.gateway.dialects.base import EngineCall
from harnessrl.services.gateway.dialects.openai_passthrough import (
    Passthrough,
    check_flags,
    check_model,
)
from harnessrl.services.gateway.errors import OPENAI, ErrorShape, invalid
from harnessrl.trust.contract import CHAT_PATH
from harnessrl.v1 import events_pb2 as pb


class ChatDialect:
    kind: str = "chat"
    api: int = pb.API_OPENAI_CHAT
    errors: ErrorShape = OPENAI

    def translate(self, body: dict[str, Any], claims: EpisodeClaims) -> EngineCall:
        model = check_model(body.get("model"))
        check_flags(body, "stream", "return_token_ids")
        logprobs = body.get("logprobs")
        if not isinstance(logprobs, bool | None):
            raise invalid("logprobs", "must be a boolean")
        render = Passthrough(model, body.get("return_token_ids") is True, logprobs is True)
        budget = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        return EngineCall(
            CHAT_PATH, body, body.get("stream") is True, model, render, budget, "messages"
        )
