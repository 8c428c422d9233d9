"""A nesting limit on request bodies, enforced as soon as they are parsed.

The JSON parser accepts 1,024 levels; the encoder the gateway uses to forward a body
(orjson) stops at 254, and recursive code further along (schema translation, pydantic) has
limits of its own. A body nested deeper than `gateway.max_json_depth` is therefore refused
at the edge, with a 400 naming the field where it goes too deep, so nothing the parser
accepts can fail later.
"""

from __future__ import annotations

from typing import Any

from harnessrl.services.gateway.errors import GatewayError


def check_depth(body: Any, limit: int) -> None:
    """Raise GatewayError(400) when `body` nests containers more than `limit` deep (the
    body itself is level 1)."""
    # Iterative, and only over containers: strings and numbers are never pushed.
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            path = ".".join(_path_to_depth(body, limit + 1)) or "body"
            raise GatewayError(400, f"{path}: nested more than {limit} levels deep", path)
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))


def _path_to_depth(body: Any, depth: int) -> list[str]:
    """The keys and indexes leading to a container at `depth` (one exists)."""
    stack: list[tuple[Any, list[str]]] = [(body, [])]
    while stack:
        node, path = stack.pop()
        if len(path) + 1 >= depth:
            return path
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if isinstance(child, dict | list):
                stack.append((child, [*path, str(key)]))
    return []
