"""examples/swe-coder/build.py: the rules of its planted two-way circuit, its replies as
Qwen3's template renders them, and its fix command on the task's line. (The model itself is
checked by the build, which verifies what it wrote; it takes ~40 s, so it is not run here.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "examples" / "swe-coder" / "build.py"


@pytest.fixture(scope="module")
def build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("swe_coder_build", BUILD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def test_rules_branch_where_the_replies_part_and_join_again(build: ModuleType) -> None:
    rules = build.rules([[1, 2, 3, 4, 7, 8], [1, 2, 3, 5, 7, 8]])
    by_current = {r.current: r for r in rules}
    assert by_current[3].nexts == (4, 5)
    assert (by_current[4].nexts, by_current[5].nexts, by_current[7].nexts) == ((7,), (7,), (8,))
    assert all(r.distance == 0 for r in rules)


def test_rules_take_the_least_context_that_decides(build: ModuleType) -> None:
    # 2 is followed by 3 after 1 and by 4 after 6: the previous token decides; 5 by 6 and
    # by 7, both after 9: the token two back (3, 4) decides; 3 alone decides
    rules = build.rules([[0, 1, 2, 3, 9, 5, 6, 2, 4, 9, 5, 7]])
    context = {(r.current, r.key): (r.distance, r.nexts) for r in rules}
    assert context[(2, 1)] == (1, (3,)) and context[(2, 6)] == (1, (4,))
    assert context[(5, 3)] == (2, (6,)) and context[(5, 4)] == (2, (7,))
    assert context[(3, 3)] == (0, (9,))


def test_rules_refuse_replies_that_need_more_context(build: ModuleType) -> None:
    with pytest.raises(SystemExit, match="token 4 needs more than two tokens"):
        build.rules([[0, 1, 2, 3, 4, 5, 9, 2, 3, 4, 6]])


def test_replies_are_what_qwen3_renders_for_the_bash_calls(build: ModuleType) -> None:
    if not build.PACKAGE.is_dir():
        pytest.skip(f"{build.PACKAGE} is missing: `make qwen3-tiny` installs it")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(build.PACKAGE)
    first, later = build.prompts(tokenizer)  # asserts each reply is the rendered call
    assert later.startswith(first + build.REPLIES[1])
    assert later.endswith("<|im_start|>assistant\n")
    assert build.FIX_COMMAND in build.REPLIES[1] and build.SUBMIT in build.REPLIES[0]


def test_fix_command_swaps_the_tasks_arguments_back(tmp_path: Path, build: ModuleType) -> None:
    lines = [
        '    MovedModule("configparser", "ConfigParser"),',
        '    MovedModule("copy_reg", "copyreg"),',
        '    MovedModule("dbm_gnu", "gdbm", "dbm.gnu"),',
        "import copyreg",
    ]
    (tmp_path / "six.py").write_text("\n".join(lines) + "\n")
    subprocess.run(["bash", "-c", build.FIX_COMMAND], cwd=tmp_path, check=True)
    lines[1] = '    MovedModule("copyreg", "copy_reg"),'
    assert (tmp_path / "six.py").read_text() == "\n".join(lines) + "\n"
