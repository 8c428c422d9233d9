"""One import name per module: the package is laid out by pyproject.toml's mapping alone.

libs/harnessrl is the library; services/, apps/ and bench/ are mapped into it as
`harnessrl.services`, `harnessrl.apps` and `harnessrl.bench`. No link gives a module a second
name, no code imports one by its folder's name, the package list is every folder with code,
and the images copy every mapped folder. The wheel itself is built and installed in a fresh
venv by tests/integration/test_wheel.py.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.typecheck import ROOT, RUNS_ELSEWHERE, package_folders

MAPPED = ("libs/harnessrl", "services", "apps", "bench")
# What the repository holds besides the package, which may import it but is not part of it.
READERS = ("tests", "examples", "protos", "deploy")


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_no_link_in_the_repository() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in listed if line.startswith("120000 ")]
    assert not links, f"symbolic links give modules a second name: {links}"
    for folder in MAPPED:
        found = [p for p in (ROOT / folder).rglob("*") if p.is_symlink()]
        assert not found, found


def test_the_package_list_is_every_folder_with_code() -> None:
    mapped = _setuptools()["package-dir"]
    assert sorted(mapped.values()) == sorted(MAPPED)
    folders = package_folders()
    with_code = {
        path.parent
        for root in MAPPED
        for path in (ROOT / root).rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert with_code == set(folders.values()), "pyproject.toml's packages and the folders differ"
    missing = [str(f.relative_to(ROOT)) for f in with_code if not (f / "__init__.py").exists()]
    assert not missing, f"a package without __init__.py: {missing}"


def _imported(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_modules_are_imported_by_their_one_name() -> None:
    """`services.gateway...` or `apps.cli` would load a second copy of a module: its classes,
    registries and metrics would be different objects from the package's."""
    folder_names = {"services", "apps", "bench", "libs"}
    wrong = []
    for root in (*MAPPED, *READERS):
        for path in (ROOT / root).rglob("*.py"):
            if "node_modules" in path.parts or ".venv" in path.parts:
                continue
            for name in _imported(path):
                if name.split(".")[0] in folder_names:
                    wrong.append(f"{path.relative_to(ROOT)}: import {name}")
    assert not wrong, "\n".join(wrong)
    # module names in strings too (commands, `python -m`, `module:Class` settings)
    pattern = re.compile(r"""["'](?:services|apps|bench|libs\.harnessrl)\.[a-z_]+\.""")
    strings = [
        f"{path.relative_to(ROOT)}"
        for root in MAPPED
        for path in (ROOT / root).rglob("*.py")
        if pattern.search(path.read_text())
    ]
    assert not strings, strings


def test_every_image_copies_every_mapped_folder() -> None:
    """An image built without one of the folders installs a package that fails on import."""
    dockerfiles = {"deploy/Dockerfile": (ROOT / "deploy" / "Dockerfile").read_text()}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        inline = (service.get("build") or {}).get("dockerfile_inline", "")
        if "pip install" in inline and "/opt/harnessrl" in inline:
            dockerfiles[f"docker-compose.yml:{name}"] = inline
    assert len(dockerfiles) >= 2
    for where, text in dockerfiles.items():
        copied = {line.split()[1] for line in text.splitlines() if line.strip().startswith("COPY")}
        top = {folder.split("/")[0] for folder in MAPPED}
        assert top <= copied, f"{where} does not copy {sorted(top - copied)}"


def test_every_third_party_import_of_the_shipped_code_is_declared() -> None:
    """A package the wheel imports but does not declare arrives only as some other
    package's dependency, and leaves the day that package stops needing it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(Requirement(line).name) for line in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        if extra is not project["optional-dependencies"]["dev"]:
            declared |= {canonicalize_name(Requirement(line).name) for line in extra}
    providers = importlib.metadata.packages_distributions()
    missing = []
    for root in MAPPED:
        for path in sorted((ROOT / root).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where in RUNS_ELSEWHERE or "/v1/" in where:
                continue
            for name in _imported(path) | _imported_inside(path):
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in ("harnessrl", "__future__"):
                    continue
                dists = {canonicalize_name(d) for d in providers.get(top, [top])}
                if not dists & declared:
                    missing.append(f"{where}: {top} (from {sorted(dists)})")
    assert not missing, "imported but not declared in pyproject.toml:\n" + "\n".join(missing)


def _imported_inside(path: Path) -> set[str]:
    """Modules imported by `importlib.import_module("...")` with a constant name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def test_the_image_installs_the_lock_and_nothing_unhashed_besides_the_project() -> None:
    """The image runs what CI tested: every dependency from requirements/runtime.lock with
    its hashes, and the project on top without resolving anything again."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    installs = [line for line in re.split(r"(?<!\\)\n", text) if "pip install" in line]
    locked = [line for line in installs if "-r requirements/runtime.lock" in line]
    assert locked and all("--require-hashes" in line for line in locked), installs
    assert "COPY requirements/runtime.lock" in text
    project = [line for line in installs if line.rstrip().endswith(" .") or " . &&" in line]
    assert project and all("--no-deps" in line for line in project), installs
    assert text.index("-r requirements/runtime.lock") < text.index("COPY libs")
