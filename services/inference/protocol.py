"""Requests the engine accepts, validated at the edge: OpenAI's shapes plus vLLM's fields.

Unknown fields are ignored, as vLLM does; fields the engine cannot honour (penalties, logit
bias, structured output) are refused with a 400 that names them rather than silently
ignored, since an RL harness that relies on them would otherwise train on something else.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from harnessrl.services.inference.sampling import SamplingParams

MAX_N = 16


class ApiError(Exception):
    """An error answered in OpenAI's error shape."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        default = "invalid_request_error" if 400 <= self.status < 500 else "api_error"
        kind = {404: "not_found_error"}.get(self.status, default)
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, which every error of this API carries (for the OpenAPI schema)."""

    error: ErrorObject


class _Lenient(BaseModel):
    """Lenient about fields it does not know (ignored, as vLLM does), strict about the types
    of those it does: a JSON boolean is not a token id or a count, a string not a number or a
    flag, so what the schema refuses is refused (pydantic's lax mode would coerce them)."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionSpec(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("must be a JSON Schema of type 'object'")
        return value


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(_Lenient):
    include_usage: bool = False


class _Sampling(_Lenient):
    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # Refused unless neutral (below); the schema says so, for clients and fuzzers.
    presence_penalty: float = Field(default=0.0, json_schema_extra={"enum": [0]})
    frequency_penalty: float = Field(default=0.0, json_schema_extra={"enum": [0]})
    logit_bias: dict[str, float] | None = Field(
        default=None, json_schema_extra={"maxProperties": 0}
    )

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.presence_penalty or self.frequency_penalty:
            field = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise ValueError(f"{field}: penalties are not supported by this engine")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported by this engine")
        return self

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling(self, max_tokens: int, choice: int) -> SamplingParams:
        """Parameters of choice `choice`: seeded requests give each choice its own seed."""
        seed = None if self.seed is None else self.seed + choice
        return SamplingParams(self.temperature, self.top_p, max_tokens, self.stops(), seed)


class _Conversation(_Lenient):
    """A conversation the chat template renders: what chat completions and the chat form of
    `/tokenize` share, so that both build the same prompt from the same fields."""

    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template reads them (dicts, `developer` as `system`)."""
        messages = []
        for m in self.messages:
            data = m.model_dump(exclude_none=True)
            if data["role"] == "developer":
                data["role"] = "system"
            messages.append(data)
        return messages

    def template_tools(self) -> list[dict[str, Any]] | None:
        """Tools as the chat template reads them; none when `tool_choice` is "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


class ChatCompletionRequest(_Conversation, _Sampling):
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {'type': 'text'} is supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})
    suffix: str | None = Field(default=None, json_schema_extra={"maxLength": 0})

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        # One message for the four shapes, rather than the first union member's complaint.
        if isinstance(value, str) or _token_ids(value):
            return value
        if isinstance(value, list) and (
            all(isinstance(p, str) for p in value) or all(_token_ids(p) for p in value)
        ):
            return value
        raise ValueError("must be a string, a list of token ids (integers), or a list of either")

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported by this engine")
        if self.suffix:
            raise ValueError("suffix: not supported by this engine")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a single prompt or a batch of them."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)  # type: ignore[arg-type]  # list[str] | list[list[int]]


class TokenizeCompletionRequest(_Lenient):
    """`/tokenize`'s completion form: the ids of `prompt` as `/v1/completions` encodes it."""

    model: str | None = None
    prompt: str
    # False, not vLLM's True: this engine's completions encode prompts without special
    # tokens, and the count must be the one a completion is served with.
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Conversation):
    """`/tokenize`'s chat form: the prompt ids chat completions build for the same messages,
    tools and tool choice (their `prompt_token_ids`), given the defaults below."""

    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_ending(self) -> TokenizeChatRequest:
        if self.continue_final_message:
            if "add_generation_prompt" in self.model_fields_set and self.add_generation_prompt:
                raise ValueError(
                    "continue_final_message: cannot be true with add_generation_prompt true"
                )
            self.add_generation_prompt = False  # continuing a message starts no new one
        return self


def _tokenize_form(data: Any) -> str | None:
    """The form of a `/tokenize` body: the field it carries (None: neither, or both)."""
    if not isinstance(data, dict):
        return "chat"  # the chat form's own error: the body must be an object
    forms = [
        form for form, field in (("chat", "messages"), ("completion", "prompt")) if field in data
    ]
    return forms[0] if len(forms) == 1 else None


TokenizeRequest = Annotated[
    Annotated[TokenizeChatRequest, Tag("chat")]
    | Annotated[TokenizeCompletionRequest, Tag("completion")],
    Discriminator(
        _tokenize_form,
        custom_error_type="tokenize_form",
        custom_error_message="needs exactly one of `messages` (the chat form) or `prompt` "
        "(the completion form)",
    ),
]


class TokenizeResponse(BaseModel):
    """What `/tokenize` answers, as vLLM does; `token_strs` only when asked for."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


def _token_ids(value: Any) -> bool:
    """A list of integers (JSON booleans are not token ids)."""
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )
