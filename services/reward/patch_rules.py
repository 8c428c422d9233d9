"""Which changes of a patch builtin:tests refuses, and which it undoes before the run.

A patch may change the code under test, nothing that decides how the tests run or what
they report. The rules are read against the task's commit (`Pristine`, built before the
patch is applied) and applied to every path the patch touched (`repo_copy.changes`). A
refused path scores the episode 0 with its flag; a path takes the first rule it meets:

- tests_modified: a test file changed, added, deleted or renamed: the task's
  `protected_paths`, the paths its test command names, `test_*.py` and `*_test.py`
  anywhere, anything under a `test/` or `tests/` directory; also an `__init__.py` added to
  or removed from a directory holding tests or above one (it changes how pytest imports
  and names them).
- conftest_added / conftest_modified: a `conftest.py` anywhere, new / changed or deleted.
- gitattributes_modified: a `.gitattributes` anywhere (its filters and line-end rules
  change how git compares the copy with the commit, which these rules read).
- test_config_modified: pytest's configuration changed, added or removed anywhere
  (`pytest_config.settings_of`: the pytest part of pyproject.toml, setup.cfg and tox.ini,
  so a fix may touch the rest of them).
- runner_patched: what runs before or inside the test runner rather than under test:
  `sitecustomize` / `usercustomize` modules and `.pth` files anywhere; package metadata
  declaring a pytest plugin (a `pytest11` entry point); a new top-level module at an import
  root (the repository, `src`, the test command's PYTHONPATH) named as a standard-library
  or runner module (`pytest.py`, `argparse.py`: found before the real one); a changed
  module that the commit's configuration or conftests load as a plugin (`-p name`,
  `pytest_plugins`); and code that newly reaches into the runner (`runner_references`:
  imports of pytest, _pytest, pluggy or py, strings naming them, `pytest_plugins`,
  `pytest_*` hook functions), compared with the file's version in the commit.
- compiled_code: bytecode (`.pyc`, `.pyo`, in `__pycache__` or not) or native code (`.so`,
  `.pyd`, `.dylib`, `.dll`) added or changed: code no reading of the patch sees, which
  Python may run in place of the source.
- symlink_added: a symbolic link created or changed (it can put any file, in or out of the
  repository, where a test or the runner reads).

Undone before the run, without a flag (`leftovers`): `.pytest_cache` and package metadata
(`*.egg-info`, `*.dist-info` not declaring a pytest plugin), the leftovers of a harness
that ran the tests or installed the project in its workspace; and stray tests: a new
test-like file outside the guarded paths and away from every directory holding the task's
tests (an agent's `test_repro.py`), which the task's tests cannot reach.

The code scan is a tripwire for the plain forms, not a proof: code the patch puts in the
package runs inside the test process and can reach the runner in ways no reading of it
catches. The run's own checks (`run_report`, `grading`) are the second line.
"""

from __future__ import annotations

import ast
import posixpath
import re
import sys
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import PurePosixPath

from harnessrl.services.reward.pytest_config import CONFIG_NAMES, settings_of
from harnessrl.services.reward.repo_copy import Change

RUNNER_MODULES = frozenset({"pytest", "_pytest", "pluggy", "py"})
"""The test runner's own modules: package code has no business importing them."""
SHADOWED = (
    frozenset(sys.stdlib_module_names)
    | RUNNER_MODULES
    | {
        "iniconfig",
        "packaging",
        "pygments",
        "colorama",
        "exceptiongroup",
        "tomli",
        "setuptools",
        "pkg_resources",
        "_distutils_hack",
    }
)
"""Top-level module names the interpreter or pytest import before any test: a module of the
copy by one of these names, on the path first, would run in their place."""
TEST_DIRS = frozenset({"test", "tests"})
TEST_FILES = ("test_*.py", "*_test.py")
"""pytest's default `python_files`."""
_STARTUP = frozenset({"sitecustomize", "usercustomize"})
_COMPILED = (".pyc", ".pyo", ".so", ".pyd", ".dylib", ".dll")
_MODULE_FILES = (".py", ".pyc", ".pyo", ".so", ".pyd")
_METADATA = (".egg-info", ".dist-info")
_CACHES = frozenset({".pytest_cache"})
_RUNNER_WORD = re.compile(r"pytest|pluggy", re.IGNORECASE)
_RUNNER_WORDS = re.compile(r"\b_?pytest\w*|\bpluggy\b")

Contents = Mapping[str, tuple[bytes | None, bytes | None]]
"""Path -> (its content in the commit, its content after the patch); None where absent."""


@dataclass(frozen=True, slots=True)
class Pristine:
    """What the task's commit says about its tests, read before the patch is applied."""

    guarded: tuple[str, ...]
    """Protected paths and the repository paths the test command names: any change under
    one is a test change."""
    test_dirs: frozenset[str]
    """Directories holding test files, and all their ancestors ("" is the root)."""
    plugin_files: frozenset[str]
    """Files of the modules the commit's configuration and conftests load as plugins."""
    roots: tuple[str, ...]
    """Import roots: "", "src" and the test command's relative PYTHONPATH entries."""
    named: tuple[str, ...] = ()
    """The repository paths the test command names (all it collects, when there are any)."""


def pristine(
    files: Iterable[str],
    protected: Sequence[str],
    command: Sequence[str],
    plugin_modules: Iterable[str],
) -> Pristine:
    """The commit's view (`files`: its paths; `command`: the test command's words)."""
    files = frozenset(files)
    roots = _import_roots(command)
    named = [p for p in _command_paths(command) if p in files or _holds(files, p)]
    guarded = (*protected, *named)
    test_dirs = {""}
    for path in files:
        if _is_test(path, guarded) or PurePosixPath(path).name == "conftest.py":
            test_dirs |= _ancestors(path)
    candidates = {
        f"{root}/{name.replace('.', '/')}".lstrip("/") + suffix
        for name in plugin_modules
        for root in (*roots, *test_dirs)
        for suffix in (".py", "/__init__.py")
    }
    return Pristine(
        guarded, frozenset(test_dirs), frozenset(candidates & files), roots, tuple(named)
    )


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why one path of the patch is refused."""

    flag: str
    path: str
    why: str


def needs_contents(change: Change) -> bool:
    """Whether `refusals` reads this path's contents (config files, Python source, package
    metadata entry points)."""
    name = PurePosixPath(change.path).name
    return name in CONFIG_NAMES or name.endswith(".py") or name == "entry_points.txt"


def refusals(
    changes: Sequence[Change], links: set[str], contents: Contents, pristine: Pristine
) -> list[Refusal]:
    """The refused paths, in the order of `changes`. `links`: the changed paths that are
    symbolic links after the patch; `contents`: as `needs_contents` asks (a path left out
    reads as absent on both sides)."""
    found = []
    for change in changes:
        before, after = contents.get(change.path, (None, None))
        refusal = _refusal(change, change.path in links, before, after, pristine)
        if refusal is not None:
            found.append(refusal)
    return found


def leftovers(changes: Sequence[Change], pristine: Pristine) -> list[str]:
    """The changed paths undone before the run: caches, package metadata and stray tests."""
    return [c.path for c in changes if _leftover(c.path.split("/")) or _stray_test(c, pristine)]


def _stray_test(change: Change, pristine: Pristine) -> bool:
    """A new test-like module the task's tests never reach (an agent's `test_repro.py`):
    added outside the guarded paths and every `tests/` directory, where the test command
    names the paths it collects, so pytest never imports it. Removed before the run rather
    than refused: it cannot change what runs, and a fix that leaves one behind is still a
    fix. (A `conftest.py` or an `__init__.py` is never stray: pytest imports those on its
    way to the named paths.)"""
    path = change.path
    name = PurePosixPath(path).name
    return (
        change.kind == "added"
        and bool(pristine.named)
        and name not in ("conftest.py", "__init__.py")
        and not any(path == g or path.startswith(g + "/") for g in pristine.guarded)
        and not any(part in TEST_DIRS for part in path.split("/")[:-1])
        and any(fnmatchcase(name, pattern) for pattern in TEST_FILES)
    )


def _refusal(
    change: Change, link: bool, before: bytes | None, after: bytes | None, pristine: Pristine
) -> Refusal | None:
    path, kind = change.path, change.kind
    parts = path.split("/")
    name = parts[-1]
    if _stray_test(change, pristine):
        return None  # removed before the run (`leftovers`)
    if _is_test(path, pristine.guarded):
        return Refusal("tests_modified", path, f"a test file ({kind})")
    if name == "__init__.py" and kind != "modified" and _dir(path) in pristine.test_dirs:
        return Refusal("tests_modified", path, f"a package marker in a test directory ({kind})")
    if name == "conftest.py":
        flag = "conftest_added" if kind == "added" else "conftest_modified"
        return Refusal(flag, path, f"pytest configuration code ({kind})")
    if name == ".gitattributes":
        return Refusal("gitattributes_modified", path, "changes how git compares the copy")
    if name in CONFIG_NAMES and settings_of(path, before) != settings_of(path, after):
        return Refusal("test_config_modified", path, "changes pytest's configuration")
    why = _runner_change(change, parts, before, after, pristine)
    if why is not None:
        return Refusal("runner_patched", path, why)
    if kind != "deleted" and name.lower().endswith(_COMPILED):
        return Refusal("compiled_code", path, "compiled code in place of source")
    if kind != "deleted" and link:
        return Refusal("symlink_added", path, "a symbolic link")
    return None


def _runner_change(
    change: Change, parts: list[str], before: bytes | None, after: bytes | None, p: Pristine
) -> str | None:
    name = parts[-1]
    if any(part.split(".")[0] in _STARTUP for part in parts):
        return "imported by Python at startup"
    if name.lower().endswith(".pth"):
        return "a path configuration file (site runs its import lines)"
    if name == "entry_points.txt" and _in_metadata(parts) and after and b"pytest11" in after:
        return "declares a pytest plugin (entry point group pytest11)"
    if change.kind == "added" and (module := _shadowed(parts, p.roots)) is not None:
        return f"a module named {module!r} on the import path, before the real one"
    if change.path in p.plugin_files:
        return "a module the tests' configuration loads as a pytest plugin"
    if name.endswith(".py") and change.kind != "deleted":
        new = new_runner_references(before or b"", after or b"")
        if new:
            return f"reaches into the test runner: {', '.join(new[:3])}"
    return None


def new_runner_references(before: bytes, after: bytes) -> list[str]:
    """The references to the test runner (`runner_references`) that `after` holds beyond
    `before`'s, sorted. Where either does not parse (a syntax this Python lacks, say),
    both are searched as text for the runner's names instead."""
    old, new = runner_references(before), runner_references(after)
    if old is None or new is None:
        old, new = _words(before), _words(after)
    return sorted((new - old).keys())


def _words(source: bytes) -> Counter[str]:
    text = source.decode("utf-8", "replace")
    return Counter(f"the word {w!r}" for w in _RUNNER_WORDS.findall(text))


def runner_references(source: bytes) -> Counter[str] | None:
    """How often Python source refers to the test runner, by kind of reference; None when
    it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    docstrings = {id(node) for node in _docstrings(tree)}
    refs: Counter[str] = Counter()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            refs.update(f"import {a.name}" for a in node.names if _runner_module(a.name))
        elif (reference := _reference(node, docstrings)) is not None:
            refs[reference] += 1
    return refs


def _reference(node: ast.AST, docstrings: set[int]) -> str | None:
    """The runner reference one node (not an `import`) makes, if any."""
    if isinstance(node, ast.ImportFrom):
        runner = node.level == 0 and node.module and _runner_module(node.module)
        return f"from {node.module} import" if runner else None
    if isinstance(node, ast.Constant) and id(node) not in docstrings:
        value = node.value
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if isinstance(text, str) and _RUNNER_WORD.search(text):
            return f"the string {text[:40]!r}"
        return None
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return "pytest_plugins" if name == "pytest_plugins" else None
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return f"the hook {node.name}" if node.name.startswith("pytest_") else None
    return None


def _docstrings(tree: ast.Module) -> Iterable[ast.AST]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                yield first.value


def _runner_module(module: str) -> bool:
    return module.split(".", 1)[0] in RUNNER_MODULES


def _is_test(path: str, guarded: Sequence[str]) -> bool:
    if any(path == g or path.startswith(g + "/") for g in guarded):
        return True
    parts = path.split("/")
    return any(p in TEST_DIRS for p in parts[:-1]) or any(
        fnmatchcase(parts[-1], pattern) for pattern in TEST_FILES
    )


def _shadowed(parts: list[str], roots: Sequence[str]) -> str | None:
    """The top-level module the path makes importable at one of the roots, when its name
    is in SHADOWED."""
    for root in roots:
        prefix = root.split("/") if root else []
        rest = parts[len(prefix) :]
        if parts[: len(prefix)] != prefix or not rest:
            continue
        if len(rest) == 1 and rest[0].endswith(_MODULE_FILES):
            module = rest[0].split(".")[0]
        elif len(rest) == 2 and rest[1].startswith("__init__."):
            module = rest[0]
        else:
            continue
        if module in SHADOWED:
            return module
    return None


def _leftover(parts: list[str]) -> bool:
    if any(part in _CACHES for part in parts):
        return True
    return _in_metadata(parts) and not parts[-1].lower().endswith(_COMPILED)


def _in_metadata(parts: list[str]) -> bool:
    return any(part.endswith(_METADATA) for part in parts[:-1])


def _command_paths(command: Sequence[str]) -> list[str]:
    """Words of the test command that may name repository paths: not options, not
    assignments; a node id's file part ("tests/test_x.py::test_a" names tests/test_x.py)."""
    paths = []
    for word in command:
        if word.startswith("-") or "=" in word or "{" in word:
            continue
        path = _relative(word.split("::", 1)[0])
        if path:
            paths.append(path)
    return paths


def _import_roots(command: Sequence[str]) -> tuple[str, ...]:
    roots = ["", "src"]
    for word in command:
        if word.startswith("PYTHONPATH="):
            for entry in word.removeprefix("PYTHONPATH=").split(":"):
                root = _relative(entry)
                if root is not None and root not in roots:
                    roots.append(root)
    return tuple(roots)


def _relative(path: str) -> str | None:
    """The path normalised and relative ("" for the root); None when absolute, empty or
    leaving the repository."""
    if not path or path.startswith("/"):
        return None
    normal = posixpath.normpath(path)
    if normal == ".":
        return ""
    return None if normal.startswith("..") else normal


def _holds(files: frozenset[str], directory: str) -> bool:
    return any(f.startswith(directory + "/") for f in files)


def _dir(path: str) -> str:
    return posixpath.dirname(path)


def _ancestors(path: str) -> set[str]:
    found = {""}
    parts = path.split("/")[:-1]
    for i in range(1, len(parts) + 1):
        found.add("/".join(parts[:i]))
    return found
