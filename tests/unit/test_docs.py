"""The documentation stays true to the code: the configuration reference is regenerated and
compared, and every relative link in README.md and docs/ names a file (and heading) there."""

from __future__ import annotations

import re
from pathlib import Path

from harnessrl.apps.cli.config_reference import COMMAND, render

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_configuration_reference_is_current() -> None:
    page = ROOT / "docs" / "configuration.md"
    assert page.is_file(), f"docs/configuration.md is missing: run `{COMMAND}`"
    assert page.read_text() == render(), (
        f"docs/configuration.md is stale (a settings field changed): run `make docs` ({COMMAND})"
    )


def test_configuration_reference_lists_every_field_with_its_variable() -> None:
    text = render()
    for variable in (
        "HARNESSRL_KAFKA__BOOTSTRAP_SERVERS",
        "HARNESSRL_LOG__LEVEL",
        "HARNESSRL_CONTROLLER__SANDBOX__MODE",
        "HARNESSRL_TRAINER__LORA__RANK",
        "HARNESSRL_VLLM_SYNC__LORA_NAME",
    ):
        assert f"`{variable}`" in text, variable
    assert "| `partitions`<br>`HARNESSRL_KAFKA__PARTITIONS` | `int` | `6` | >= 1 |" in text


def anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_relative_links_name_files_and_headings_that_exist() -> None:
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            where = f"{page.relative_to(ROOT)}: ({target})"
            resolved = (page.parent / path).resolve() if path else page
            assert "shared" not in Path(path).parts, f"{where} points outside the repository"
            assert resolved.is_relative_to(ROOT), f"{where} points outside the repository"
            assert resolved.exists(), f"{where}: no such file"
            if fragment and resolved.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)
                assert fragment in {anchor(h) for h in headings}, f"{where}: no such heading"


TRUST = ROOT / "libs" / "harnessrl" / "trust"


def _trust_table() -> list[str]:
    """The modules ARCHITECTURE.md's "Trust path" table lists, in its order."""
    section = (ROOT / "ARCHITECTURE.md").read_text().split("\n## Trust path\n", 1)[1]
    section = section.split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)\.py` \|", section, flags=re.M)


def test_the_trust_path_is_read_in_one_order_everywhere() -> None:
    """ARCHITECTURE.md's table and the package's own reading list name every module of
    libs/harnessrl/trust, in the same order."""
    files = sorted(p.stem for p in TRUST.glob("*.py") if p.stem != "__init__")
    table = _trust_table()
    assert sorted(table) == files, "ARCHITECTURE.md's trust path table and the files differ"
    docstring = (TRUST / "__init__.py").read_text().split('"""')[1]
    listed = re.findall(r"^    ([a-z_]+) ", docstring, flags=re.M)
    assert listed == table, "harnessrl.trust's reading list and ARCHITECTURE.md's differ"


def test_the_trust_path_size_stated_is_its_size() -> None:
    stated = re.search(r"libs/harnessrl/trust/, about ([\d,]+) lines", PAGES[1].read_text())
    assert stated, "ARCHITECTURE.md no longer states the trust path's size"
    lines = sum(len(p.read_text().splitlines()) for p in TRUST.glob("*.py"))
    size = int(stated.group(1).replace(",", ""))
    assert abs(lines - size) <= 0.1 * lines, f"the trust path is {lines} lines, not ~{size}"
