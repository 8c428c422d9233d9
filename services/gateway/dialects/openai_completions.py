"""`POST /v1/completions`: OpenAI's (legacy) completions, which the engine speaks itself.

The prompt may be text or token ids (so a harness can send exact tokens); the gateway checks
only the fields it reads, as for chat.
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
from harnessrl.trust.contract import COMPLETIONS_PATH
from harnessrl.v1 import events_pb2 as pb


class CompletionsDialect:
    kind: str = "completions"
    api: int = pb.API_OPENAI_COMPLETIONS
    errors: ErrorShape = OPENAI

    def translate(self, body: dict[str, Any], claims: EpisodeClaims) -> EngineCall:
        model = check_model(body.get("model"))
        check_flags(body, "stream", "return_token_ids")
        logprobs = body.get("logprobs")
        if not isinstance(logprobs, int | None) or isinstance(logprobs, bool):
            raise invalid("logprobs", "must be an integer")
        render = Passthrough(model, body.get("return_token_ids") is True, logprobs is not None)
        return EngineCall(
            COMPLETIONS_PATH,
            body,
            body.get("stream") is True,
            model,
            render,
            "max_tokens",
            "prompt",
        )
