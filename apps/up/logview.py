"""Render the services' JSON log lines as one readable, service-prefixed line each."""

from __future__ import annotations

from typing import Any

import orjson

NAME_WIDTH = 14
_COLORS = (36, 33, 32, 35, 34, 96, 93, 92, 95)
_HIDDEN = ("ts", "level", "service", "logger", "msg", "span_id", "exc")


class LogView:
    """Formats lines from named sources: `HH:MM:SS.mmm level  <name> msg key=value ...`.

    Each name gets a fixed column width and, with `color`, a stable ANSI color. Lines that
    are not JSON log records pass through unchanged after the name.
    """

    def __init__(self, names: list[str], *, color: bool) -> None:
        self._color = color
        self._codes = {name: _COLORS[i % len(_COLORS)] for i, name in enumerate(names)}

    def label(self, name: str) -> str:
        padded = f"{name:<{NAME_WIDTH}}"
        code = self._codes.get(name)
        return f"\x1b[{code}m{padded}\x1b[0m" if self._color and code else padded

    def render(self, name: str, line: str) -> str:
        """One raw output line of `name`'s process, ready to print (may span lines for a
        traceback)."""
        record = _parse(line)
        if record is None:
            return f"{' ' * 21}{self.label(name)} {line}"
        ts = str(record.get("ts", ""))[11:23]
        level = str(record.get("level", ""))
        fields = " ".join(f"{k}={_text(v)}" for k, v in record.items() if k not in _HIDDEN)
        text = f"{ts:<12} {level:<7} {self.label(name)} {record['msg']}"
        if fields:
            text += f" {fields}"
        if "exc" in record:
            text += "\n" + str(record["exc"])
        return text

    def note(self, msg: str) -> str:
        """A line of `up`'s own."""
        return f"{' ' * 21}{self.label('up')} {msg}"


def _parse(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(record, dict) or "msg" not in record:
        return None
    return record


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else orjson.dumps(value, default=str).decode()
    return f'"{text}"' if " " in text else text
