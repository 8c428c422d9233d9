"""What of a repository's files pytest reads as its configuration, and which plugins they load.

pytest takes its settings from the first of these it finds walking up from its arguments:
`pytest.ini`, `.pytest.ini`, `pytest.toml`, `.pytest.toml` (wholly pytest's, even empty),
`pyproject.toml` (its `[tool.pytest]` table, `ini_options` included), `tox.ini` (its
`[pytest]` section) and `setup.cfg` (its `[tool:pytest]` section). `settings_of` gives the
part of such a file that configures pytest, so that two versions of `pyproject.toml` or
`setup.cfg` that differ only elsewhere (a version bump, a linter setting) compare equal,
while any change pytest would see compares unequal.

The ini sections are cut as pytest's ini parser (iniconfig) cuts them: a section starts at a
line whose first character is "[" and runs to the next such line; an indented line is a
continuation, never a header. Every section of the name is kept (duplicates included), so
the cut errs on the side of seeing a change.
"""

from __future__ import annotations

import ast
import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import PurePosixPath

WHOLE_FILES = frozenset({"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml"})
"""Files that are pytest configuration from their first byte."""
_INI_SECTIONS = {"tox.ini": ("pytest",), "setup.cfg": ("tool:pytest", "pytest")}
CONFIG_NAMES = WHOLE_FILES | {"pyproject.toml", *_INI_SECTIONS}
"""Every file name that can hold pytest configuration."""
_TOKEN = re.compile(r"[^\s\"',\[\]=]+")
_MODULE = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*")


def settings_of(path: str, data: bytes | None) -> str | None:
    """The pytest configuration in the file at `path` (its name decides how it is read) with
    content `data`, as canonical text; None when the file is absent or configures nothing.

    A `pyproject.toml` that does not parse yields a text of its own ("unparsable: ..."):
    pytest refuses to start on it, and it is not the same configuration as a valid one.
    """
    if data is None:
        return None
    name = PurePosixPath(path).name
    text = data.decode("utf-8", "surrogateescape")
    if name in WHOLE_FILES:
        return text
    if name == "pyproject.toml":
        try:
            table = tomllib.loads(text).get("tool", {}).get("pytest")
        except (tomllib.TOMLDecodeError, AttributeError) as err:
            return f"unparsable: {err}"
        return None if table is None else json.dumps(table, sort_keys=True, default=str)
    if name in _INI_SECTIONS:
        sections = [s for s in _ini_sections(text) if s[0] in _INI_SECTIONS[name]]
        return "\n".join(body for _, body in sections) if sections else None
    return None


def _ini_sections(text: str) -> Iterator[tuple[str, str]]:
    """(name, the section's text from its header on) for each section, as iniconfig sees
    them: a header is a line starting with "[" (comments after "#" or ";" dropped)."""
    name: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("["):
            if name is not None:
                yield name, "\n".join(lines)
            header = re.split(r"[#;]", line, maxsplit=1)[0].rstrip()
            name, lines = header[1:-1] if header.endswith("]") else header, [line]
        elif name is not None:
            lines.append(line)
    if name is not None:
        yield name, "\n".join(lines)


def plugins_in_settings(settings: str) -> set[str]:
    """Module names that pytest settings load as plugins with `-p name` (in `addopts`); a
    superset: any "-p" token followed by a module name, wherever it stands."""
    tokens = _TOKEN.findall(settings)
    names = set()
    for i, token in enumerate(tokens):
        if token == "-p" and i + 1 < len(tokens):
            names.add(tokens[i + 1])
        elif token.startswith("-p") and len(token) > 2:
            names.add(token[2:])
    return {n for n in names if _MODULE.fullmatch(n)}


def plugins_in_conftest(data: bytes) -> set[str]:
    """Module names a conftest.py loads as plugins: the strings assigned to `pytest_plugins`
    (one name, or a list or tuple of them). A conftest that does not parse loads nothing."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in targets):
                value = node.value
                items = value.elts if isinstance(value, ast.List | ast.Tuple) else [value]
                names |= {
                    item.value
                    for item in items
                    if isinstance(item, ast.Constant) and isinstance(item.value, str)
                }
    return {n for n in names if _MODULE.fullmatch(n)}
