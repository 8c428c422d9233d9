"""builtin:tests' reading of a patch: pytest's configuration in a file, and which changed
paths are refused (`patch_rules`), pure functions over paths and contents."""

from __future__ import annotations

import pytest

from harnessrl.services.reward.patch_rules import (
    Pristine,
    leftovers,
    new_runner_references,
    pristine,
    refusals,
)
from harnessrl.services.reward.pytest_config import (
    plugins_in_conftest,
    plugins_in_settings,
    settings_of,
)
from harnessrl.services.reward.repo_copy import Change

PYPROJECT = """[project]
name = "calc"
version = "1.0"

[tool.pytest.ini_options]
addopts = "-q"
"""
SETUP_CFG = """[metadata]
name = calc

[tool:pytest]
addopts = -q
  --strict-markers

[flake8]
max-line-length = 100
"""


@pytest.mark.parametrize(
    ("path", "before", "after", "same"),
    [
        ("pyproject.toml", PYPROJECT, PYPROJECT.replace('"1.0"', '"1.1"'), True),
        ("pyproject.toml", PYPROJECT, PYPROJECT.replace('"-q"', "\"-q -k 'not x'\""), False),
        ("pyproject.toml", '[project]\nname = "c"\n', '[tool.pytest]\naddopts = ["-q"]\n', False),
        ("pyproject.toml", PYPROJECT, PYPROJECT + "[tool.pytest\n", False),  # unparsable
        ("pyproject.toml", None, '[build-system]\nrequires = ["x"]\n', True),
        ("setup.cfg", SETUP_CFG, SETUP_CFG.replace("= 100", "= 120"), True),
        ("setup.cfg", SETUP_CFG, SETUP_CFG.replace("--strict-markers", "--deselect t.py"), False),
        # an indented "[x]" continues the section in pytest's parser: it is no header
        (
            "setup.cfg",
            SETUP_CFG,
            SETUP_CFG.replace("  --strict", "  [x]\n  -k y\n  --strict"),
            False,
        ),
        ("setup.cfg", SETUP_CFG, SETUP_CFG.replace("[tool:pytest]", "[tool:pytest] ; c"), False),
        ("setup.cfg", SETUP_CFG, SETUP_CFG + "\n[tool:pytest]\naddopts = -x\n", False),
        ("tox.ini", "[tox]\nenvlist = py3\n", "[tox]\nenvlist = py311\n", True),
        ("tox.ini", "[tox]\n", "[tox]\n\n[pytest]\naddopts = -x\n", False),
        ("pytest.ini", None, "", False),  # an empty pytest.ini is a config file
        ("tests/.pytest.ini", "[pytest]\n", "[pytest]\n\n", False),
    ],
)
def test_pytest_settings_compare_equal_only_when_pytest_sees_the_same(
    path: str, before: str | None, after: str | None, same: bool
) -> None:
    def read(text: str | None) -> str | None:
        return settings_of(path, None if text is None else text.encode())

    assert (read(before) == read(after)) is same


def test_plugins_named_by_settings_and_conftests() -> None:
    assert plugins_in_settings(
        "[pytest]\naddopts = -p a.plugin -pb_plugin -p no:cacheprovider"
    ) == {
        "a.plugin",
        "b_plugin",
    }
    assert plugins_in_settings('{"addopts": ["-p", "toml_plugin"]}') == {"toml_plugin"}
    conftest = b"pytest_plugins = ['x.fixtures', 'y']\nother = ['z']\n"
    assert plugins_in_conftest(conftest) == {"x.fixtures", "y"}
    assert plugins_in_conftest(b"pytest_plugins = 'one'\n") == {"one"}
    assert plugins_in_conftest(b"def broken(:\n") == set()


COMMAND = (
    "env",
    "PYTHONPATH=lib:.",
    "python",
    "-m",
    "pytest",
    "-p",
    "no:x",
    "tests/test_x.py::test_a",
)
FILES = [
    "calc.py",
    "pkg/__init__.py",
    "pkg/core.py",
    "pkg/helpers/plugin.py",
    "tests/test_x.py",
    "tests/conftest.py",
    "json.py",
]
VIEW = pristine(FILES, ["tests"], COMMAND, {"pkg.helpers.plugin"})


def test_pristine_view_of_the_commit() -> None:
    assert VIEW.guarded == ("tests", "tests/test_x.py")
    assert VIEW.roots == ("", "src", "lib")
    assert VIEW.test_dirs == {"", "tests"}
    assert VIEW.plugin_files == {"pkg/helpers/plugin.py"}


def _refused(
    path: str,
    kind: str = "added",
    before: bytes | None = None,
    after: bytes | None = b"",
    link: bool = False,
    view: Pristine = VIEW,
) -> str | None:
    change = Change(path, kind)  # type: ignore[arg-type]  # kinds are written out below
    found = refusals([change], {path} if link else set(), {path: (before, after)}, view)
    return found[0].flag if found else None


@pytest.mark.parametrize(
    ("path", "kind", "flag"),
    [
        ("tests/test_x.py", "modified", "tests_modified"),
        ("tests/data/input.txt", "added", "tests_modified"),
        ("pkg/test_core.py", "added", None),  # stray: removed before the run (leftovers)
        ("pkg/test_core.py", "modified", "tests_modified"),
        ("pkg/core_test.py", "deleted", "tests_modified"),
        ("src/pkg/tests/helpers.py", "added", "tests_modified"),
        ("__init__.py", "added", "tests_modified"),
        ("pkg/__init__.py", "modified", None),
        ("pkg/sub/__init__.py", "added", None),
        ("conftest.py", "added", "conftest_added"),
        ("docs/conftest.py", "added", "conftest_added"),
        ("pkg/conftest.py", "deleted", "conftest_modified"),
        ("tests/conftest.py", "modified", "tests_modified"),  # protected first
        ("pkg/.gitattributes", "added", "gitattributes_modified"),
        ("sitecustomize.py", "added", "runner_patched"),
        ("pkg/sitecustomize/__init__.py", "added", "runner_patched"),
        ("usercustomize.py", "added", "runner_patched"),
        ("deep/dir/boot.pth", "added", "runner_patched"),
        ("pytest.py", "added", "runner_patched"),
        ("_pytest/__init__.py", "added", "runner_patched"),
        ("src/argparse.py", "added", "runner_patched"),
        ("lib/inspect.py", "added", "runner_patched"),  # lib is on the command's PYTHONPATH
        ("pkg/json.py", "added", None),  # pkg.json, not json
        ("json.py", "modified", None),  # the commit's own choice
        ("pkg/helpers/plugin.py", "modified", "runner_patched"),
        ("pkg/_speed.cpython-311-x86_64-linux-gnu.so", "added", "compiled_code"),
        ("pkg/__pycache__/core.cpython-311.pyc", "added", "compiled_code"),
        ("legacy.pyc", "modified", "compiled_code"),
        ("legacy.pyc", "deleted", None),
        ("pkg/core.py", "modified", None),
        ("README.md", "added", None),
    ],
)
def test_each_changed_path_meets_its_rule(path: str, kind: str, flag: str | None) -> None:
    assert _refused(path, kind, after=None if kind == "deleted" else b"x = 1\n") == flag


def test_symbolic_links_are_refused() -> None:
    assert _refused("data", link=True, after=None) == "symlink_added"
    assert _refused("tests/test_x.py", "modified", link=True) == "tests_modified"


def test_package_metadata_is_refused_only_when_it_declares_a_pytest_plugin() -> None:
    entry_points = "evil-1.0.dist-info/entry_points.txt"
    assert _refused(entry_points, after=b"[pytest11]\nevil = evil\n") == "runner_patched"
    assert _refused(entry_points, after=b"[console_scripts]\nx = x:main\n") is None
    assert _refused("calc.egg-info/PKG-INFO") is None
    changes = [
        Change("calc.egg-info/PKG-INFO", "added"),
        Change(".pytest_cache/v/cache/lastfailed", "added"),
        Change("pkg/core.py", "modified"),
    ]
    assert leftovers(changes, VIEW) == [
        "calc.egg-info/PKG-INFO",
        ".pytest_cache/v/cache/lastfailed",
    ]
    # An agent's reproduction test, outside the tests the command names: removed too.
    stray = [Change("test_repro.py", "added"), Change("pkg/test_core.py", "added")]
    assert leftovers(stray, VIEW) == ["test_repro.py", "pkg/test_core.py"]
    assert leftovers([Change("tests/test_new.py", "added")], VIEW) == []  # refused instead


def test_config_change_is_refused_but_not_a_change_elsewhere_in_the_file() -> None:
    before = SETUP_CFG.encode()
    elsewhere = SETUP_CFG.replace("= 100", "= 120").encode()
    deselect = SETUP_CFG.replace("--strict-markers", "--deselect t.py").encode()
    assert _refused("setup.cfg", "modified", before, elsewhere) is None
    assert _refused("setup.cfg", "modified", before, deselect) == "test_config_modified"
    assert _refused("setup.cfg", "deleted", before, None) == "test_config_modified"
    assert _refused("pkg/pytest.ini", "added", None, b"[pytest]\n") == "test_config_modified"


@pytest.mark.parametrize(
    ("before", "after", "new"),
    [
        (b"x = 1\n", b"import pytest\nx = 1\n", ["import pytest"]),
        (b"x = 1\n", b"from _pytest import runner\n", ["from _pytest import"]),
        (b"x = 1\n", b"import pluggy.hooks\n", ["import pluggy.hooks"]),
        (
            b"x = 1\n",
            b"import sys\nsys.modules['_pytest.skipping']\n",
            ["the string '_pytest.skipping'"],
        ),
        (b"x = 1\n", b"def pytest_configure(config):\n    pass\n", ["the hook pytest_configure"]),
        (b"x = 1\n", b"pytest_plugins = []\n", ["pytest_plugins"]),
        (b"import pytest\n", b"import pytest\n\n\ndef f():\n    pass\n", []),
        (b"x = 1\n", b'"""Tested with pytest."""\nx = 1  # pytest\n', []),
        (b"x = 1\n", b"import pytestify\n", []),
        # a syntax this Python may lack: searched as text
        (b"x = 1\n", b"type X[T] = list[T] if (\nimport pytest\n", ["the word 'pytest'"]),
    ],
    ids=[
        "import",
        "from-import",
        "pluggy",
        "module-name-string",
        "hook",
        "pytest-plugins",
        "already-there",
        "docstring-and-comment",
        "another-module",
        "unparsable",
    ],
)
def test_code_newly_reaching_into_the_runner_is_found(
    before: bytes, after: bytes, new: list[str]
) -> None:
    assert new_runner_references(before, after) == new
    expected = "runner_patched" if new else None
    assert _refused("pkg/core.py", "modified", before, after) == expected
