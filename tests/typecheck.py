"""mypy over the package under the names it is installed with (`make lint`).

pyproject.toml maps three top-level folders into the package (services/ is
`harnessrl.services`, apps/ `harnessrl.apps`, bench/ `harnessrl.bench`). mypy names a file by
the folders above it, so it is given each file with its module name, read from the same
mapping setuptools builds the wheel from. Settings come from [tool.mypy].
"""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


RUNS_ELSEWHERE = {
    "services/reward/testguard.py": "the task's own interpreter, inside the test jail (pytest)",
    "services/reward/caserunner.py": "the task's own interpreter, inside the test jail (pytest)",
}
"""Shipped files that run in another interpreter than the project's, with what they import
there: they are copied, never imported by the package."""


def package_folders(root: Path = ROOT) -> dict[str, Path]:
    """Each package pyproject.toml lists, and the folder its modules are in."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setuptools["package-dir"]
    folders = {}
    for package in setuptools["packages"]:
        prefix = max((p for p in mapped if package == p or package.startswith(p + ".")), key=len)
        rest = package[len(prefix) :].lstrip(".").replace(".", "/")
        folders[package] = root / mapped[prefix] / rest
    return folders


def sources(root: Path = ROOT) -> Iterator[BuildSource]:
    for package, folder in package_folders(root).items():
        stubs = {p.stem for p in folder.glob("*.pyi")}
        for path in sorted(folder.glob("*.py*")):
            if path.suffix == ".py" and path.stem in stubs:
                continue  # the stub types the module (the generated protobuf code)
            if path.suffix not in (".py", ".pyi"):
                continue
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            yield BuildSource(str(path.relative_to(root)), name, None)


def main() -> int:
    _, options = process_options(
        ["--config-file", str(ROOT / "pyproject.toml")], require_targets=False
    )
    try:
        result = build.build(list(sources()), options)
        messages = result.errors
    except CompileError as error:
        messages = error.messages
    for line in messages:
        print(line)
    checked = sum(1 for _ in sources())
    if messages:
        print(f"mypy: {len(messages)} lines of errors in {checked} files", file=sys.stderr)
        return 1
    print(f"mypy: no issues found in {checked} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
