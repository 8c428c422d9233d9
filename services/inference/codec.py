"""Text <-> token ids for the served model, and chat prompts through its chat template."""

from __future__ import annotations

from typing import Any

from harnessrl.services.inference.protocol import ApiError


class TextCodec:
    """Wraps a Hugging Face tokenizer: the one place text becomes ids and back."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Prompt ids of a conversation, ending with the assistant generation prompt.

        Raises ApiError(400) when the template refuses the conversation.
        """
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as err:  # jinja2 raises TemplateError and friends for bad input
            raise ApiError(
                400, f"messages: the chat template rejected them: {err}", "messages"
            ) from err
        return self.encode(str(text))

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens (end of turn, ...) left out."""
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def token_text(self, token_id: int) -> str:
        """The text of one token as shown in log-probs (special tokens included)."""
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's end-of-turn token(s)."""
        ids = set()
        for name in ("eos_token_id",):
            value = getattr(self.tokenizer, name, None)
            if isinstance(value, int):
                ids.add(value)
        return frozenset(ids)
