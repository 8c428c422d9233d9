"""The doctor's renderers: terminal summary, self-contained HTML and JSON, with data and without."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

from harnessrl.apps.doctor.report_html import write_html
from harnessrl.apps.doctor.report_text import summary, write_json

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "max": None, "min": None}
    ordered = sorted(values)
    return {
        "n": len(ordered),
        "mean": sum(ordered) / len(ordered),
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[int(0.9 * len(ordered))],
        "max": ordered[-1],
        "min": ordered[0],
    }


def _check(id_: str, section: str, verdict: str, **text: str) -> dict[str, Any]:
    return {
        "id": id_,
        "section": section,
        "title": text.get("title", id_.split(".")[1].replace("_", " ")),
        "verdict": verdict,
        "value": text.get("value", "0.00 of calls"),
        "threshold": text.get("threshold", "ok < 0.05, warn < 0.25, fail >= 0.25"),
        "detail": text.get("detail", ""),
        "fix": text.get("fix", ""),
    }


CHECKS = [
    _check(
        "merge.breaks",
        "merging",
        "fail",
        title="chains broken by the harness",
        value="0.42 of calls",
        detail="The harness rewrites its system prompt on every call (it puts the current "
        "time in it), so no call extends the chain the one before it recorded.",
        fix="Keep the system prompt fixed for the whole episode; put changing facts in a "
        "user message instead.",
    ),
    _check("merge.side_chains", "merging", "ok"),
    _check(
        "tokens.overhead",
        "tokens",
        "warn",
        title="tokens trained over the least a merge could",
        value="1.62x",
        threshold="ok < 1.2, warn < 2, fail >= 2",
        detail="Broken chains repeat their shared prefix in every sequence.",
        fix="Fix merge.breaks first.",
    ),
    _check("tools.parse", "tools", "ok", title="tool-call markup parsed", value="1.00"),
    _check("wire.context", "wire", "n/a", title="context limit", value="unknown"),
    _check("outcome.reward", "outcome", "ok", title="reward spread", value="3 of 8 groups"),
]


def _full_report() -> dict[str, Any]:
    context = [
        {"episode": e, "seq": s, "tokens": 400 + 350 * s + 7 * e}
        for e in range(60)
        for s in range(6)
    ]
    break_points = [
        {"episode": e, "seq": s, "kind": kind, "position": 12 + s, "prompt_tokens": 400 + 350 * s}
        for e in range(60)
        for s, kind in ((1, "chat_template"), (3, "retokenization"))
    ]
    rewards = [float(i % 3 == 0) for i in range(60)]
    return {
        "run": {
            "started_at": 1_700_000_000.0,
            "minutes": 3.25,
            "mode": "train",
            "config": "examples/calculator/harnessrl.yaml",
            "tasks": "examples/calculator/tasks.jsonl",
            "episodes": 60,
            "stack": "own",
        },
        "verdict": "fail",
        "checks": CHECKS,
        "merging": {
            "episodes": 60,
            "calls": 360,
            "calls_per_episode": _stats([6.0] * 60),
            "chains_per_episode": _stats([3.0] * 60),
            "extend_share": 0.6,
            "breaks": {
                "chat_template": 60,
                "retokenization": 60,
                "compaction": 0,
                "side_chain": 0,
                "other": 0,
            },
            "temperature_breaks": 0,
            "top_break": {
                "kind": "chat_template",
                "count": 60,
                "episode_id": "ep-0007",
                "seq": 1,
                "nearest_seq": 0,
                "position": 13,
                "role": "system",
                "line": 2,
                "sent": "now: 12:01 <script>alert(1)</script> & more",
                "recorded": "now: 12:00 & less",
                "cause": "The system prompt changed between calls <b>",
                "fix": "Keep it fixed & move the time to a user message.",
            },
            "break_points": break_points,
        },
        "tokens": {
            "prompt_per_call": _stats([400.0 + 350 * s for s in range(6)]),
            "completion_per_call": _stats([40.0] * 6),
            "prompt_per_episode": _stats([7650.0] * 60),
            "completion_per_episode": _stats([240.0] * 60),
            "per_call_tokens": 473_400,
            "sequence_tokens": 180_000,
            "minimum_tokens": 111_000,
            "overhead": 1.6216,
            "captured": 14_400,
            "trained": 13_000,
            "trained_share": 0.9028,
            "dropped": {"length": 1400},
        },
        "tools": {
            "offered": True,
            "markup_calls": 200,
            "parsed_calls": 198,
            "unparsed_calls": 2,
            "unparsed_examples": [
                {
                    "episode_id": "ep-0003",
                    "seq": 2,
                    "finish_reason": "length",
                    "text": '<tool_call>{"name": "add", "arguments": {"a": 1',
                }
            ],
            "tool_calls_per_episode": _stats([3.3] * 60),
            "episodes_without_tool_call": 1,
        },
        "wire": {
            "bodies": True,
            "dialects": {"openai_chat": 360},
            "requests": {"/v1/chat/completions": {"200": 358, "400": 2}},
            "errors": {"/v1/chat/completions": {"400": 2}},
            "clamped": 3,
            "max_tokens_asked": _stats([512.0] * 360),
            "finish_reasons": {"stop": 300, "tool_calls": 58, "length": 2},
            "overrides": [
                {
                    "field": "temperature",
                    "calls": 360,
                    "harness_values": ["0.2"],
                    "train": "forced to 1.0",
                }
            ],
            "context_limit": 4096,
            "context": context,
            "max_context_share": 0.61,
        },
        "outcome": {
            "statuses": {"finished": 60},
            "rewards": rewards,
            "reward": _stats(rewards),
            "groups": 8,
            "zero_variance_groups": 3,
            "missing_rewards": 0,
            "call_seconds": _stats([0.4] * 360),
            "episode_seconds": _stats([2.5] * 60),
        },
    }


def _empty_report() -> dict[str, Any]:
    nothing = _stats([])
    return {
        "run": {
            "started_at": 1_700_000_000.0,
            "minutes": 0.0,
            "mode": "val",
            "config": "harnessrl.yaml",
            "tasks": "tasks.jsonl",
            "episodes": 0,
            "stack": "stack.json",
        },
        "verdict": "ok",
        "checks": [],
        "merging": {
            "episodes": 0,
            "calls": 0,
            "calls_per_episode": nothing,
            "chains_per_episode": nothing,
            "extend_share": None,
            "breaks": {
                k: 0
                for k in ("chat_template", "retokenization", "compaction", "side_chain", "other")
            },
            "temperature_breaks": 0,
            "top_break": None,
            "break_points": [],
        },
        "tokens": {
            "prompt_per_call": nothing,
            "completion_per_call": nothing,
            "prompt_per_episode": nothing,
            "completion_per_episode": nothing,
            "per_call_tokens": 0,
            "sequence_tokens": 0,
            "minimum_tokens": 0,
            "overhead": None,
            "captured": 0,
            "trained": 0,
            "trained_share": None,
            "dropped": {},
        },
        "tools": {
            "offered": False,
            "markup_calls": 0,
            "parsed_calls": 0,
            "unparsed_calls": 0,
            "unparsed_examples": [],
            "tool_calls_per_episode": nothing,
            "episodes_without_tool_call": 0,
        },
        "wire": {
            "bodies": False,
            "dialects": {},
            "requests": {},
            "errors": {},
            "clamped": 0,
            "max_tokens_asked": nothing,
            "finish_reasons": {},
            "overrides": [],
            "context_limit": None,
            "context": [],
            "max_context_share": None,
        },
        "outcome": {
            "statuses": {},
            "rewards": [],
            "reward": nothing,
            "groups": 0,
            "zero_variance_groups": 0,
            "missing_rewards": 0,
            "call_seconds": nothing,
            "episode_seconds": nothing,
        },
    }


def _images(page: str) -> list[bytes]:
    return [
        base64.b64decode(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)
    ]


def test_summary_lists_every_check_and_ends_with_the_verdict() -> None:
    lines = summary(_full_report()).splitlines()
    for check in CHECKS:
        assert any(line.split()[1:2] == [check["id"]] for line in lines), check["id"]
    assert lines[-1] == "verdict: FAIL (1 warn, 1 fail)"
    assert all("\x1b" not in line for line in lines)


def test_summary_explains_warn_and_fail_checks_only() -> None:
    text = summary(_full_report())
    flat = " ".join(text.split())
    assert "puts the current time in it" in flat
    assert "fix: Keep the system prompt fixed for the whole episode" in flat
    assert "fix: Fix merge.breaks first." in flat
    assert max(len(line) for line in text.splitlines()) <= 100


def test_summary_shows_headline_figures() -> None:
    flat = " ".join(summary(_full_report()).split())
    assert "episodes 60" in flat
    assert "overhead 1.62x" in flat
    assert "zero-variance groups 3 of 8" in flat


def test_summary_of_an_empty_report_has_no_checks_and_an_ok_verdict() -> None:
    lines = summary(_empty_report()).splitlines()
    assert lines[-1] == "verdict: OK (0 warn, 0 fail)"
    assert "overhead -" in " ".join(" ".join(lines).split())


def test_html_embeds_three_plots_and_escapes_harness_text(tmp_path: Path) -> None:
    path = write_html(_full_report(), tmp_path / "out" / "doctor.html")
    page = path.read_text(encoding="utf-8")
    images = _images(page)
    assert len(images) == 3
    assert all(image.startswith(PNG_SIGNATURE) for image in images)
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page
    assert "<script>" not in page
    assert "&lt;b&gt;" in page
    for check in CHECKS:
        assert f"<td>{check['id']}</td>" in page
    assert "<td class='v-fail'>fail</td>" in page
    assert "<td class='v-na'>n/a</td>" in page
    assert "class='banner v-fail'" in page
    assert "How to read this" in page


def test_html_of_an_empty_report_shows_placeholders(tmp_path: Path) -> None:
    page = write_html(_empty_report(), tmp_path / "doctor.html").read_text(encoding="utf-8")
    assert len(_images(page)) == 3
    assert "no breaks" in page
    assert "no data" in page


def test_json_round_trips(tmp_path: Path) -> None:
    report = _full_report()
    path = write_json(report, tmp_path / "doctor.json")
    text = path.read_text(encoding="utf-8")
    assert text.endswith("}\n")
    assert json.loads(text) == report
