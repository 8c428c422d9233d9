"""The configuration reference (docs/configuration.md), rendered from the settings classes.

Every section a service reads, as the service registry lists them: the shared sections once
(`kafka`, `producer`, `consumer`, `telemetry`, `log`), then each service's own, nested
sections and list items included. Each field is one table row: its name and environment
variable, type, default, bounds and docstring (the settings classes keep field docstrings
as descriptions, `use_attribute_docstrings`). The output depends on the classes alone, so
tests/unit/test_docs.py regenerates it and fails when the committed page is stale.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from harnessrl import registry
from harnessrl.config import ServiceConfig

COMMAND = ".venv/bin/harnessrl config reference > docs/configuration.md"
"""How the page is regenerated (the staleness test names it)."""

HEADER = f"""\
# Configuration reference

What every setting of every service is, generated from the settings classes' field
docstrings. `make docs` regenerates it, running
`{COMMAND}`;
a test fails when it is stale. Every service reads one optional YAML file (`--config FILE`
or `$HARNESSRL_CONFIG`) whose top-level keys are the sections below; a service reads the
shared sections and its own, and ignores the others. Environment variables override the
file: `HARNESSRL_<SECTION>__<FIELD>`, nested sections joined by `__` too
(`HARNESSRL_CONTROLLER__SANDBOX__MODE=bwrap`); lists and mappings are given as JSON. Values
are validated once, at start-up: a bad one is refused with the field's name and the reason.
What a service would run with, secrets masked, and what each field means:

```bash
.venv/bin/harnessrl config show broker --describe
```

Kafka security (TLS, SASL) is in the shared `kafka` section: `security_protocol`,
`sasl_mechanism`, `sasl_username`, `sasl_password`, `ssl_cafile` and the other `ssl_*`
fields.
"""

_BOUNDS = (
    (annotated_types.Ge, "ge", ">="),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "<="),
    (annotated_types.Lt, "lt", "<"),
    (annotated_types.MinLen, "min_length", "length >="),
    (annotated_types.MaxLen, "max_length", "length <="),
)


def render() -> str:
    """The whole page as Markdown. Deterministic: nothing of the machine it runs on."""
    parts = [HEADER, "## Shared sections (every service)\n"]
    shared = ServiceConfig.model_fields
    parts += _top_level(ServiceConfig, shared)
    for spec in registry.SERVICES:
        cls = spec.config_class()
        own = {n: f for n, f in cls.model_fields.items() if n not in shared}
        parts.append(f"## `harnessrl {spec.name}`\n\nSettings class `{spec.config}`.\n")
        parts += _top_level(cls, own)
    return "\n".join(parts)


def _top_level(cls: type[BaseModel], fields: dict[str, FieldInfo]) -> list[str]:
    """Plain fields of a settings class as one table, then each section field's table."""
    plain = {n: f for n, f in fields.items() if _section_of(f.annotation) is None}
    parts = [_table(plain, "")] if plain else []
    for name, field in fields.items():
        if name not in plain:
            parts += _section(name, field, name)
    return parts


def _section(path: str, field: FieldInfo, env: str | None) -> list[str]:
    """One section's heading, table and nested sections; `path` is its YAML key path, `env`
    its environment variable without HARNESSRL_ (None: its fields have none)."""
    model, shape = _section_of(field.annotation) or (BaseModel, "")
    note = {
        "optional": " Optional: unset (null) by default.",
        "list": " A list: each item has these fields (as JSON in the environment).",
        "dict": " A mapping from a name to an item with these fields.",
    }.get(shape, "")
    description = _text(field.description)
    parts = [f"### `{path}`\n\n{description}{note}\n"]
    rows: dict[str, FieldInfo] = {}
    nested: list[tuple[str, FieldInfo]] = []
    for name, sub in model.model_fields.items():
        if _section_of(sub.annotation):
            nested.append((name, sub))
        else:
            rows[name] = sub
    # Items of a list or mapping have no variable of their own: the whole value is JSON.
    env_prefix = env if env is not None and shape in ("", "optional") else None
    parts.append(_table(rows, env_prefix))
    for name, sub in nested:
        suffix = {"list": "[]", "dict": ".<name>"}.get(shape, "")
        sub_env = f"{env_prefix}__{name}" if env_prefix is not None else None
        parts += _section(f"{path}{suffix}.{name}", sub, sub_env)
    return parts


def _table(fields: dict[str, FieldInfo], env: str | None) -> str:
    """Fields as table rows; `env`: their variables' prefix after HARNESSRL_ ("" at the top
    level, None when they have none)."""
    lines = ["| field | type | default | bounds | what it is |", "|---|---|---|---|---|"]
    for name, field in fields.items():
        variable = f"HARNESSRL_{env}__{name}" if env else f"HARNESSRL_{name}"
        key = f"`{name}`" if env is None else f"`{name}`<br>`{variable.upper()}`"
        cells = (
            key,
            _code(_type(field.annotation)),
            _default(field),
            _bounds(field),
            _text(field.description),
        )
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _section_of(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """(model, shape) when the annotation is a settings section: the model itself (shape
    ""), the model or None ("optional"), a list of them ("list") or a mapping to them
    ("dict"); None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if a is not type(None)]
        if len(models) == 1 and _section_of(models[0]) == (models[0], ""):
            return models[0], "optional"
    if origin is list and args and _section_of(args[0]) == (args[0], ""):
        return args[0], "list"
    if origin is dict and len(args) == 2 and _section_of(args[1]) == (args[1], ""):
        return args[1], "dict"
    return None


def _type(annotation: Any) -> str:
    """A type as a reader writes its values: Literal choices quoted, Optional as `| None`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if annotation is SecretStr:
        return "secret"
    if annotation is Path:
        return "path"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        return "computed at start-up"
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "see below"
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, tuple):
        value = list(value)
    return _code(json.dumps(value))


def _bounds(field: FieldInfo) -> str:
    found = []
    for meta in field.metadata:
        for kind, attribute, sign in _BOUNDS:
            if isinstance(meta, kind):
                found.append(f"{sign} {getattr(meta, attribute)}")
    return ", ".join(found)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _text(description: str | None) -> str:
    return " ".join((description or "").split())
