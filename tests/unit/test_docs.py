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
