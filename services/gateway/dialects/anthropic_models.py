"""Anthropic Messages requests as the gateway accepts them, validated at the edge.

Types are checked strictly (a string is not a number, `1` is not `true`) and unknown fields
are ignored, as the SDK sends fields this engine has no use for (`metadata`, `thinking`,
`cache_control`, ...). Content given as a string is read as one text block. Block types the
engine cannot honour (`image`, `document`, server-tool blocks) are refused by name. Errors
name the field by its path in the request body, as Anthropic's API does
(`messages.2.content.0.type: ...`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import ErrorDetails

from harnessrl.services.gateway.errors import GatewayError


def invalid(message: str) -> GatewayError:
    """A 400 `invalid_request_error`; `message` starts with the field's path."""
    return GatewayError(400, message)


class _Edge(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


def _blocks(value: object) -> object:
    """Content as a list of blocks: a string is one text block."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise ValueError("must be a string or a list of content blocks")
    return value


class TextBlock(_Edge):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Edge):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Edge):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = []
    is_error: bool = False

    @field_validator("content", mode="before", json_schema_input_type=str | list[TextBlock])
    @classmethod
    def _content_blocks(cls, value: object) -> object:
        return _blocks(value)


class ThinkingBlock(_Edge):
    """Earlier reasoning sent back by the harness; dropped (the chat template decides what
    past reasoning the model sees, and this engine has no signatures to check)."""

    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")
]


class InputMessage(_Edge):
    role: Literal["user", "assistant", "system"]  # the SDK's SystemMessageParam: text only
    content: list[Block]

    @field_validator("content", mode="before", json_schema_input_type=str | list[Block])
    @classmethod
    def _content_blocks(cls, value: object) -> object:
        return _blocks(value)


class CustomTool(_Edge):
    type: Literal["custom"] | None = None  # first: a server tool is refused for its type
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]

    @field_validator("type", mode="before")
    @classmethod
    def _custom_only(cls, value: object) -> object:
        if value not in (None, "custom"):
            raise ValueError(
                f"{value!r} tools are not supported by this engine: only custom tools "
                "(name, description, input_schema)"
            )
        return value

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError("must be a JSON Schema with type 'object'")
        return value


class ToolChoiceAuto(_Edge):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Edge):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Edge):
    type: Literal["tool"]
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Edge):
    type: Literal["none"]
    disable_parallel_tool_use: bool = False


ToolChoice = Annotated[
    ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
    Field(discriminator="type"),
]


class OutputConfig(_Edge):
    format: dict[str, Any] | None = None


class MessagesRequest(_Edge):
    """`POST /v1/messages` as far as this engine can honour it."""

    model: str = Field(min_length=1, max_length=256)  # recorded in every ModelCall
    max_tokens: int = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    stream: bool = False

    @field_validator("system", mode="before", json_schema_input_type=str | list[TextBlock] | None)
    @classmethod
    def _system_blocks(cls, value: object) -> object:
        return None if value is None else _blocks(value)


def parse_request(body: object) -> MessagesRequest:
    """The validated request. Raises GatewayError(400) naming the first invalid field."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    try:
        return MessagesRequest.model_validate(body)
    except ValidationError as err:
        raise invalid(_describe(err.errors()[0], body)) from err


def _describe(error: ErrorDetails, body: dict[str, Any]) -> str:
    """`path: reason` for one pydantic error, the path written as in the request body."""
    path = _body_path(error["loc"], body, keep_last=error["type"] == "missing")
    reason = error["msg"].removeprefix("Value error, ")
    kind = error["type"]
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        path.append("type")
        tag = (error.get("ctx") or {}).get("tag")
        reason = "Field required" if tag is None else f"{tag!r} {_UNSUPPORTED}"
    elif kind == "literal_error" and path[-1:] == ["type"] and isinstance(error["input"], str):
        reason = f"{error['input']!r} {_UNSUPPORTED}"
    return f"{'.'.join(path)}: {reason}" if path else reason


_UNSUPPORTED = "is not supported by this engine"


def _body_path(loc: tuple[int | str, ...], body: dict[str, Any], *, keep_last: bool) -> list[str]:
    """The parts of a pydantic location that exist in the request body.

    Pydantic puts the tag of a discriminated union in the location (`content.0.text.text`);
    walking the body drops whatever is not a key or an index there. A missing field is not
    in the body, so the last part is kept for those.
    """
    node: Any = body
    path: list[str] = []
    for i, part in enumerate(loc):
        in_dict = isinstance(node, dict) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if in_dict or in_list:
            node = node[part]
        elif not (keep_last and i == len(loc) - 1):
            continue
        path.append(str(part))
    return path
