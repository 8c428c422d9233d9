"""One name, one concept: no two classes share a name anywhere in the package, and no two
modules share a file name for different things.

A few module names mean the same thing wherever they appear, and may repeat: each service's
`cli`, `config`, `service` and `metrics` (that service's command, its settings, its wiring,
its metric declarations), a protocol's `client`, `server` and `errors`, a package's
`__init__`/`__main__`. Two folders name their modules after something outside the code: the
CLI's command modules (`apps/cli/*.py`, one per `harnessrl` command) and the benchmarks
(`bench/*.py`, one per `harnessrl bench` benchmark), so inside them a module may share its
name with the thing it runs or measures.
"""

from __future__ import annotations

import ast
from collections import defaultdict

from tests.typecheck import package_folders

SAME_CONCEPT = frozenset(
    {"__init__", "__main__", "cli", "config", "service", "metrics", "client", "server", "errors"}
)
NAMED_AFTER_A_COMMAND = frozenset({"harnessrl.apps.cli", "harnessrl.bench"})


def _modules() -> dict[str, ast.Module]:
    found: dict[str, ast.Module] = {}
    for package, folder in package_folders().items():
        if package == "harnessrl.v1":
            continue
        for path in sorted(folder.glob("*.py")):
            found[f"{package}.{path.stem}"] = ast.parse(path.read_text(), str(path))
    return found


def test_no_two_classes_share_a_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for module, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(module)
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not shared, f"classes that share a name (rename one to say which it is): {shared}"


def test_no_two_modules_share_a_name_for_different_things() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for module in _modules():
        package, name = module.rsplit(".", 1)
        if name in SAME_CONCEPT or package in NAMED_AFTER_A_COMMAND:
            continue
        where[name].append(module)
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not shared, f"modules that share a name (rename one to say which it is): {shared}"
