"""The run report: a PNG dashboard and a self-contained HTML page, with data and without."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from matplotlib import image

from harnessrl.apps.experiment.report import write_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _val(success: float, episodes: int, by_kind: dict[str, Any]) -> dict[str, Any]:
    return {"success": success, "episodes": episodes, "versions": [0], "by_kind": by_kind}


def _metrics(run_id: str = "run-7") -> dict[str, Any]:
    episodes = [{"t": 2.0 * i, "reward": (i % 5) / 4, "version": i // 20} for i in range(90)]
    calls = [{"t": 1.5 * i, "prompt_tokens": 300, "completion_tokens": 40} for i in range(120)]
    steps = [
        {
            "t": 40.0 * (k + 1),
            "step": k + 1,
            "version": k + 1,
            "loss": 0.5 - 0.1 * k,
            "entropy": 1.2 - 0.05 * k,
            "kl": 0.001 * k,
            "clip_fraction": 0.02,
            "grad_norm": 0.8,
            "tokens_per_second": 5400.0,
        }
        for k in range(4)
    ]
    steps.append({**steps[-1], "step": 5, "loss": None, "entropy": None, "kl": None})
    return {
        "run_id": run_id,
        "config": "examples/calculator/harnessrl.yaml",
        "started_at": 1_700_000_000.0,
        "val_before": _val(0.3125, 64, {"add": {"n": 32, "success": 0.5}}),
        "val_after": _val(
            0.6875, 64, {"add": {"n": 32, "success": 0.75}, "mul": {"n": 32, "success": 0.625}}
        ),
        "train": {
            "episodes": episodes,
            "calls": calls,
            "steps": steps,
            "staleness": {"histogram": {"0": 50, "1": 30, "2": 4}, "dropped_stale": 6},
            "groups": {"emitted": 20, "zero_variance": 3, "too_few_episodes": 1},
            "merge": {
                "calls": 120,
                "segments": 126,
                "break_chat_template": 2,
                "break_retokenization": 3,
                "break_other": 1,
                "duplicates_replaced": 4,
            },
        },
        "summary": {
            "val_before": 0.3125,
            "val_after": 0.6875,
            "episodes": 90,
            "steps": 5,
            "minutes": 3.25,
        },
        "trace_hint": "Open Jaeger and search service=gateway run_id=run-7",
    }


def _empty_metrics() -> dict[str, Any]:
    return {
        "run_id": "empty",
        "config": "",
        "started_at": 0.0,
        "val_before": _val(0.0, 0, {}),
        "val_after": _val(0.0, 0, {}),
        "train": {
            "episodes": [],
            "calls": [],
            "steps": [],
            "staleness": {"histogram": {}, "dropped_stale": 0},
            "groups": {},
            "merge": {
                "calls": 0,
                "segments": 0,
                "break_chat_template": 0,
                "break_retokenization": 0,
                "break_other": 0,
                "duplicates_replaced": 0,
            },
        },
        "summary": {"val_before": 0.0, "val_after": 0.0, "episodes": 0, "steps": 0, "minutes": 0.0},
        "trace_hint": "",
    }


def _assert_png_dashboard(path: Path) -> None:
    assert path.read_bytes().startswith(PNG_SIGNATURE)
    pixels = image.imread(path)
    assert pixels.shape[:2] == (800, 1500)


def _assert_self_contained(page: str) -> None:
    assert "http://" not in page
    assert "https://" not in page
    assert re.search(r'<img [^>]*src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', page)


def test_report_writes_dashboard_png_and_page_with_summary_steps_and_kinds(
    tmp_path: Path,
) -> None:
    html_path, png_path = write_report(_metrics(), tmp_path / "run")
    assert (html_path, png_path) == (tmp_path / "run/report.html", tmp_path / "run/report.png")
    _assert_png_dashboard(png_path)
    page = html_path.read_text(encoding="utf-8")
    _assert_self_contained(page)
    assert "<title>harnessrl run run-7</title>" in page
    for number in ("0.312", "0.688", "+0.375", ">90<", ">5<", "3.2", "2023-11-14T22:13:20Z"):
        assert number in page
    assert "examples/calculator/harnessrl.yaml" in page
    assert "5400" in page  # steps table: tokens/s
    assert "<td>mul</td><td class=num></td><td class=num></td>" in page  # absent before
    assert "+0.250" in page  # kind "add": 0.5 -> 0.75
    assert "How to read this" in page
    assert "service=gateway run_id=run-7" in page


def test_report_blanks_missing_step_values(tmp_path: Path) -> None:
    html_path, _ = write_report(_metrics(), tmp_path)
    page = html_path.read_text(encoding="utf-8")
    last_step = page[page.index("<tr><td class=num>5</td>") :].split("</tr>")[0]
    assert last_step.count("<td class=num></td>") == 3  # loss, entropy, kl


def test_report_escapes_run_id_and_text(tmp_path: Path) -> None:
    metrics = _metrics(run_id="<script>alert(1)</script>")
    metrics["trace_hint"] = "look for a&b <here>"
    html_path, _ = write_report(metrics, tmp_path)
    page = html_path.read_text(encoding="utf-8")
    assert "<script>" not in page
    assert "harnessrl run &lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "look for a&amp;b &lt;here&gt;" in page


def test_report_with_no_data_still_renders_every_panel(tmp_path: Path) -> None:
    html_path, png_path = write_report(_empty_metrics(), tmp_path)
    _assert_png_dashboard(png_path)
    page = html_path.read_text(encoding="utf-8")
    _assert_self_contained(page)
    assert "harnessrl run empty" in page
    assert "1970-01-01T00:00:00Z" in page
    assert "Traces" not in page
