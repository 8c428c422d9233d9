"""Text <-> token ids for the served model, and chat prompts through its chat template."""

from __future__ import annotations

import inspect
from typing import Any

from harnessrl.services.inference.protocol import ApiError


class TextCodec:
    """Wraps a Hugging Face tokenizer: the one place text becomes ids and back."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        # Names a request's template variables must not take: the renderer's own parameters
        # (a `chat_template` would replace the template) and the variables it sets itself.
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
        self._reserved = frozenset(
            {p.name for p in parameters if p.kind is not p.VAR_KEYWORD} | {"messages"}
        )

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        *,
        generation_prompt: bool = True,
        continue_final: bool = False,
        special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt ids of a conversation. The defaults are what chat completions serve: ending
        with the assistant generation prompt, no special tokens beyond the template's.
        `continue_final` leaves the last message open instead (not with `generation_prompt`);
        `template_kwargs` are extra variables for the template.

        Raises ApiError(400) when the template refuses the conversation, or when a template
        variable is one the renderer sets itself.
        """
        extra = template_kwargs or {}
        if reserved := sorted(extra.keys() & self._reserved):
            param = f"chat_template_kwargs.{reserved[0]}"
            raise ApiError(400, f"{param}: set by the engine, not by a request", param)
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=generation_prompt,
                continue_final_message=continue_final,
                tokenize=False,
                **extra,
            )
        except Exception as err:  # jinja2 raises TemplateError and friends for bad input
            raise ApiError(
                400, f"messages: the chat template rejected them: {err}", "messages"
            ) from err
        return self.encode(str(text), special_tokens=special_tokens)

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """Ids of `text`; `special_tokens` adds the tokenizer's own (a BOS, ...), which the
        engine's routes do not."""
        ids: list[int] = self.tokenizer(text, add_special_tokens=special_tokens)["input_ids"]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids, special tokens (end of turn, ...) left out."""
        text: str = self.tokenizer.decode(ids, skip_special_tokens=True)
        return text

    def token_text(self, token_id: int) -> str:
        """The text of one token as shown in log-probs (special tokens included)."""
        text: str = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_strings(self, ids: list[int]) -> list[str]:
        """The vocabulary entry of each id (byte-level forms such as `Ġw`), as vLLM's
        `/tokenize` gives them in `token_strs`."""
        strings: list[str] = self.tokenizer.convert_ids_to_tokens(ids)
        return strings

    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's end-of-turn token(s)."""
        ids = set()
        for name in ("eos_token_id",):
            value = getattr(self.tokenizer, name, None)
            if isinstance(value, int):
                ids.add(value)
        return frozenset(ids)
