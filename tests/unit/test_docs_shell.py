"""Every shell command shown in README.md and docs/*.md is run here, run by a named test, or
in a block marked with what it needs that the test machine lacks.

A shell block (```bash, ```sh, ```shell, ```console) right after a line
`<!-- needs: KIND: reason -->` is marked: KIND is one of NEEDS (a GPU, a Kubernetes
cluster, a Docker engine, the network, or minutes of measurement) and the reason says why.
Every line of every other block must match exactly one row of COMMANDS: RUN (run here for
real, in a scratch directory that links examples/ and .venv) or where the command is run:
`FILE::NAME`, a test function that runs it (often at a smaller size: the demo's test trains
one step), or `FILE: TEXT`, a script that holds it. The test named must exist. Whether
marked or not, each `harnessrl` command shown must parse with the CLI's own parser, so its
subcommand and every flag it is given exist.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harnessrl.apps.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = {
    "gpu": "a GPU",
    "cluster": "a Kubernetes cluster",
    "docker": "a Docker engine",
    "network": "the network (PyPI, a model hub)",
    "minutes": "minutes of measurement, by hand",
}
RUN = "run here"

_EPISODE = "tests/integration/test_episode_cli.py::test_an_episode_opened_by_hand_is_served_captured_and_closed"  # noqa: E501
_BUS = "tests/integration/test_cli_flow.py::test_submit_then_tail_prints_one_json_line_per_task"
_UP = "tests/integration/test_up.py::test_up_starts_every_service_runs_an_episode_and_stops_cleanly_on_ctrl_c"  # noqa: E501
_EXPERIMENT = "tests/integration/test_experiment.py::test_experiment_measures_trains_a_step_measures_again_and_reports"  # noqa: E501
_TRACE = "tests/unit/test_trace_tree.py::test_cli_prints_the_tree"
_DOCTOR = "tests/integration/test_doctor.py::test_a_clean_harness_passes_every_check_and_the_files_are_written"  # noqa: E501
_GRPC_REWARD = (
    "tests/integration/test_reward.py::test_the_example_grpc_reward_service_scores_episodes"
)
_CODEX = (
    "tests/integration/test_harness_clis.py::"
    "test_codex_cli_default_agent_runs_through_the_gateway_and_is_captured"
)
_H = r"\.venv/bin/harnessrl"
_POLICY = "tests/integration/test_policy_cli.py::"

COMMANDS: tuple[tuple[str, str], ...] = (
    (r"make test", ".ci/run: make test"),  # CI's entry point
    (r"make demo", _EXPERIMENT),
    (rf"{_H} config show ", RUN),
    (r"\.venv/bin/python examples/calculator/tasks\.py ", RUN),
    (r"printf 'HARNESSRL_TOKEN_SECRET=", RUN),
    (rf"{_H} up --config examples/up\.yaml", _UP),
    # The same command on the stack with a longer context; test_harness_clis runs the CLIs
    # against an engine at those context lengths.
    (rf"{_H} up --config examples/coding-agents\.yaml", _UP),
    (rf'eval "\$\({_H} episode open\)"', _EPISODE),
    (r"\.venv/bin/python examples/calculator/harness\.py ", _EPISODE),
    (rf"{_H} episode close ", _EPISODE),
    (rf"{_H} broker --port \d+ &", _BUS),
    (rf"{_H} submit ", _BUS),
    (rf"{_H} events tail ", _BUS),
    (r"kill %1", _BUS),
    (
        rf"{_H} status ",
        "tests/integration/test_controller.py::"
        "test_sync_mode_starts_episodes_only_once_engines_serve_the_announced_version",
    ),
    (rf"{_H} trace .+ --spans ", _TRACE),
    (rf"{_H} experiment ", _EXPERIMENT),
    (rf"{_H} doctor ", _DOCTOR),
    (
        rf"{_H} chaos ",
        "tests/integration/test_chaos.py::"
        "test_a_minute_of_kills_and_freezes_loses_and_doubles_nothing",
    ),
    (r"mkdir -p ~/\.codex-harnessrl", _CODEX),
    (r"CODEX_HOME=~/\.codex-harnessrl codex exec ", _CODEX),
    (
        rf"{_H} bench load ",
        "tests/integration/test_bench_load.py::"
        "test_bench_load_runs_without_errors_and_captures_every_answered_call",
    ),
    (
        rf"{_H} bench http ",
        "tests/integration/test_bench_http.py::test_bench_http_measures_every_stack_in_one_run",
    ),
    (
        rf"{_H} bench sessions ",
        "tests/integration/test_bench_sessions.py::"
        "test_bench_sessions_accounts_for_every_session_from_its_call_to_its_samples",
    ),
    (
        rf"{_H} bench samples ",
        "tests/unit/test_bench_samples.py::"
        "test_bench_samples_json_prints_one_line_with_the_figures",
    ),
    (
        rf"{_H} reward --source builtin:",
        "tests/integration/test_reward.py::"
        "test_builtin_answer_ignores_a_reward_the_harness_reports_itself",
    ),
    (r"\.venv/bin/python examples/reward_service/server\.py ", _GRPC_REWARD),
    (rf"{_H} reward --source grpc:", _GRPC_REWARD),
    # The services' own commands: `harnessrl up` starts each as `harnessrl SERVICE`.
    (rf"({_H}|HARNESSRL_\S+ .*{_H}) (inference|gateway|controller|sample-builder) ", _UP),
    (rf"{_H} trainer --model ", _UP),
    (rf"{_H} trainer plan ", RUN),
    (
        rf"{_H} policy status ",
        f"{_POLICY}test_status_shows_the_rollout_the_engines_and_the_judges_evidence",
    ),
    (
        rf"{_H} policy (promote|rollback|pin|unpin) ",
        f"{_POLICY}test_operators_promote_pin_unpin_and_roll_back_and_refusals_publish_nothing",
    ),
)


@dataclass(frozen=True)
class Line:
    page: str
    text: str
    needs: str | None
    """The KIND of the block's `<!-- needs: KIND: reason -->`, or None."""

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def shown_lines() -> list[Line]:
    """Every command line of every shell block, continuations joined, comments kept."""
    found: list[Line] = []
    block = re.compile(
        r"(?:<!-- needs: (?P<kind>[a-z]+): (?P<reason>[^>]*?) -->\n)?"
        r"^(?P<indent> *)```(?:bash|sh|shell|console)\n(?P<body>.*?)^(?P=indent)```",
        flags=re.S | re.M,
    )
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        for match in block.finditer(page.read_text()):
            kind = match["kind"]
            if kind is not None:
                assert kind in NEEDS, f"{name}: needs {kind}? one of {sorted(NEEDS)}"
                assert len(match["reason"].strip()) >= 10, f"{name}: needs {kind} without a reason"
            body = re.sub(r"\\\n\s*", " ", match["body"])
            for raw in body.splitlines():
                text = re.sub(r"^\$ ", "", raw.strip())
                if text:
                    found.append(Line(name, text, kind))
    return found


LINES = shown_lines()


def covering(line: Line) -> list[str]:
    return [cover for pattern, cover in COMMANDS if re.match(pattern, line.text)]


def test_every_shown_command_is_run_covered_or_marked() -> None:
    loose = [
        f"{line} (matches {len(covering(line))} rows)"
        for line in LINES
        if line.needs is None and len(covering(line)) != 1
    ]
    assert not loose, (
        "each shell line needs exactly one row in COMMANDS of tests/unit/test_docs_shell.py, "
        "or its block a `<!-- needs: KIND: reason -->` line before it:\n" + "\n".join(loose)
    )


def test_every_row_is_used_and_names_a_test_that_exists() -> None:
    for pattern, cover in COMMANDS:
        assert any(re.match(pattern, line.text) for line in LINES), f"no line shows {pattern}"
        if cover == RUN:
            continue
        path, sep, name = cover.partition("::")
        needle = f"def {name}(" if sep else cover.partition(": ")[2]
        file = ROOT / (path if sep else cover.partition(": ")[0])
        assert file.is_file(), f"{cover}: no such file"
        assert needle in file.read_text(), f"{cover}: {needle!r} is not in {file.name}"


def test_the_census_has_every_kind_of_line() -> None:
    """The extraction sees the lines of every page: each way of being checked is in use."""
    run = [line for line in LINES if line.needs is None and covering(line) == [RUN]]
    covered = [line for line in LINES if line.needs is None and RUN not in covering(line)]
    marked = [line for line in LINES if line.needs is not None]
    assert run and covered and marked
    assert {line.needs for line in marked} >= {"gpu", "cluster", "docker"}
    assert {line.page for line in LINES} >= {"README.md", "docs/deploy.md", "docs/rewards.md"}


def harnessrl_argv(text: str) -> list[str] | None:
    """The arguments after `harnessrl` of a line that runs it directly (placeholders
    such as <episode id> made one word), or None."""
    text = re.sub(r"<[^>]*>", "PLACEHOLDER", text)
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words = words[1:]
    if not words or Path(words[0]).name != "harnessrl":
        return None
    argv = words[1:]
    for end, word in enumerate(argv):
        if word in {"&", "&&", "|", ";", ">"}:
            return argv[:end]
    return argv


HARNESSRL = [(line, argv) for line in LINES if (argv := harnessrl_argv(line.text)) is not None]


@pytest.mark.parametrize(("line", "argv"), HARNESSRL, ids=[str(line)[:90] for line, _ in HARNESSRL])
def test_each_harnessrl_command_shown_parses(line: Line, argv: list[str]) -> None:
    parser = build_parser()
    try:
        parser.parse_args(argv)
    except SystemExit as done:
        pytest.fail(f"{line}: `harnessrl {shlex.join(argv)}` does not parse (exit {done.code})")


RUNS = [line for line in LINES if line.needs is None and covering(line) == [RUN]]


@pytest.mark.parametrize("line", RUNS, ids=[str(line)[:90] for line in RUNS])
def test_each_cheap_command_shown_runs(line: Line, tmp_path: Path) -> None:
    """Run as shown, by bash, in a scratch directory (what it writes stays there)."""
    for name in ("examples", ".venv"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESSRL_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", line.text],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, f"{line}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
