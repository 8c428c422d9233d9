"""The project's layers point down only, and no import cycle exists.

    applications (harnessrl.apps.*: cli, up, experiment, doctor, chaos, swe; harnessrl.bench;
                  harnessrl.__main__, the program)
        -> services (harnessrl.services.*)
            -> the trust path (harnessrl.trust, when it is a package) and the platform
               (every other module of harnessrl: bus, http, telemetry, weights, config, ...)
                -> generated protobuf code (harnessrl.v1)

Every import counts, at module level or inside a function, under TYPE_CHECKING or not: a
deferred import is still a dependency. Modules are read from the folders pyproject.toml maps
their packages to (libs/harnessrl, services/, apps/, bench/). The sizes of the layers are printed
(`pytest -s` shows them); the trust path may not pass 3,500 lines.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

from tests.typecheck import package_folders

APPLICATIONS = frozenset({"apps", "bench", "__main__"})
LAYERS = ("generated", "platform", "trust", "services", "applications")
RANK = {"generated": 0, "platform": 1, "trust": 1, "services": 2, "applications": 3}
TRUST_LIMIT = 3500


def _sources() -> dict[str, Path]:
    """Module name -> file, for every module the wheel installs (generated code aside), read
    from the folders pyproject.toml maps each package to."""
    found: dict[str, Path] = {}
    for package, folder in package_folders().items():
        if package == "harnessrl.v1":
            continue
        for path in sorted(folder.glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "harnessrl":
        return None
    second = parts[1] if len(parts) > 1 else ""
    if second == "v1":
        return "generated"
    if second in APPLICATIONS:
        return "applications"
    if second == "services":
        return "services"
    if second == "trust":
        return "trust"
    return "platform"


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.append(full if full in modules else node.module)
        for imported in names:
            name = imported
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _sources()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_layers_point_down_only_and_print_their_sizes() -> None:
    modules, graph = _sources(), _graph()
    upward = sorted(
        f"{name} ({layer(name)}) imports {dep} ({layer(dep)})"
        for name, deps in graph.items()
        for dep in deps
        if RANK[layer(dep) or "platform"] > RANK[layer(name) or "platform"]
    )
    assert not upward, "\n".join(upward)
    sizes: dict[str, int] = defaultdict(int)
    for name, path in modules.items():
        sizes[layer(name) or "platform"] += len(path.read_text().splitlines())
    sys.stdout.write(
        "layer sizes (lines): "
        + ", ".join(f"{name} {sizes[name]:,}" for name in LAYERS if name in sizes)
        + "\n"
    )
    assert sizes.get("trust", 0) <= TRUST_LIMIT


def test_no_import_cycle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_what_they_look_for() -> None:
    """A layer test that cannot fail is a defect: the graph holds the imports it judges."""
    graph = _graph()
    assert "harnessrl.services.reward.jail" in graph["harnessrl.services.reward.patch_tests"]
    assert "harnessrl.bubblewrap" in graph["harnessrl.services.reward.jail"]
    assert layer("harnessrl.apps.swe.synth") == "applications"
    assert layer("harnessrl.services.gateway.lifecycle") == "services"
    assert layer("harnessrl.trust.capture") == "trust"
    assert "harnessrl.trust.capture" in graph["harnessrl.services.gateway.lifecycle"]
    assert layer("harnessrl.bus") == "platform"
    # a deferred import counts (swe.env imports the reward's jail inside a function)
    assert "harnessrl.services.reward.jail" in graph["harnessrl.apps.swe.env"]


# What the trust path may import: computation, never I/O. No sockets, files, processes, event
# loops, brokers, HTTP, gRPC, telemetry or logging: what it decides depends on its arguments
# alone (and `time`, read only to report how long a step took).
TRUST_MAY_IMPORT = frozenset(
    {
        "__future__", "collections", "collections.abc", "contextlib", "dataclasses", "enum",
        "hashlib", "math", "time", "typing",
        "numpy", "numpy.typing", "torch", "torch.nn.functional", "orjson",
        "harnessrl.v1", "harnessrl.events", "harnessrl.episode_token",
    }
)  # fmt: skip


def test_the_trust_path_is_pure_and_reads_in_one_sitting() -> None:
    modules = {n: p for n, p in _sources().items() if layer(n) == "trust"}
    assert "harnessrl.trust.step" in modules, "the trust package is missing"
    impure = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported = [node.module]
            else:
                continue
            for module in imported:
                if not (module.startswith("harnessrl.trust") or module in TRUST_MAY_IMPORT):
                    impure.append(f"{name} imports {module}")
    assert not impure, "\n".join(impure)
    lines = sum(len(p.read_text().splitlines()) for p in modules.values())
    sys.stdout.write(f"trust path: {len(modules)} modules, {lines:,} lines\n")
    assert lines <= TRUST_LIMIT
