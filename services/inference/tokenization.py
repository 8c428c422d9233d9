"""vLLM's `POST /tokenize`: the prompt ids a request would be served with, generating nothing.

Two forms, told apart by the field they carry. The chat form (`messages`) renders the
conversation through the codec exactly as `/v1/chat/completions` does, so with its defaults
its `tokens` are that route's `prompt_token_ids` for the same messages, tools and tool
choice: the gateway answers Anthropic's `count_tokens` with it. The completion form
(`prompt`) encodes text as `/v1/completions` does. Nothing is checked against the context
length: a count is what a client asks for to find out whether its prompt fits.
"""

from __future__ import annotations

from typing import Any

from harnessrl.services.inference.codec import TextCodec
from harnessrl.services.inference.protocol import (
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": TokenizeResponse, "description": "The prompt's token ids"},
    400: {"model": ErrorResponse, "description": "Invalid request (the field is named)"},
    404: {"model": ErrorResponse, "description": "No such model"},
}
"""What the OpenAPI document says `/tokenize` answers."""


def tokenize(
    codec: TextCodec,
    body: TokenizeChatRequest | TokenizeCompletionRequest,
    *,
    max_model_len: int,
) -> dict[str, Any]:
    """The `/tokenize` answer for `body` (a TokenizeResponse as JSON; `token_strs` only when
    asked for). Touches no engine state. Raises ApiError(400) when the chat template refuses
    the conversation or `chat_template_kwargs` sets one of the renderer's own variables."""
    if isinstance(body, TokenizeChatRequest):
        ids = codec.chat_prompt(
            body.template_messages(),
            body.template_tools(),
            generation_prompt=body.add_generation_prompt,
            continue_final=body.continue_final_message,
            special_tokens=body.add_special_tokens,
            template_kwargs=body.chat_template_kwargs,
        )
    else:
        ids = codec.encode(body.prompt, special_tokens=body.add_special_tokens)
    strings = codec.token_strings(ids) if body.return_token_strs else None
    response = TokenizeResponse(
        count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strings
    )
    return response.model_dump(exclude_none=True)
