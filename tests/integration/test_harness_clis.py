"""Real coding-agent CLIs, unmodified and on their default settings, through the gateway.

Codex CLI (`@openai/codex`, Responses API) and Claude Code (`@anthropic-ai/claude-code`,
Anthropic Messages API) are installed at pinned versions by `make harness-clis`; each runs
one non-interactive task against a real in-process stack (embedded broker, the project's
engine with the tiny model, the gateway) with only what running offline needs: a throwaway
HOME, the gateway as its provider with an episode token, and no prompts for approval. Every
model call a CLI makes must come back as a ModelCall on hrl.calls with exact token ids.

The engine's context is sized to each CLI's own prompt: their system prompts and tool
schemas are 40-50 KB, which the tiny model's small BPE turns into ~17.8k (Codex) and ~23.3k
(Claude Code) tokens; the context leaves a few hundred tokens of room above that. The
gateway clamps a completion budget to that room, and a reply cut there fails both CLIs
(Codex ends the turn on `incomplete`; Claude Code asks to continue, then to compact, and
both prompts overflow), so the untrained tiny model, which runs ~300 tokens before it
samples its end-of-turn token, would fail a run one time in five or so. The model is
therefore a copy trained to answer "hi": it does so at these lengths too, and a run is
then one prefill of the prompt, ~10-20 s on two CPU cores. A CLI release whose prompt no
longer fits shows as a 400 "prompt is too long" in its output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from harnessrl.broker import EmbeddedBroker
from harnessrl.v1 import events_pb2 as pb
from tests.harnesses import clis
from tests.integration.gateway_stack import Stack, running_stack
from tests.model_helpers import overfit

pytestmark = [pytest.mark.integration, pytest.mark.harness_cli, pytest.mark.timeout(600)]

CODEX_CONTEXT = 18_432
"""Engine context for Codex: its prompt measured 17,834 tiny-model tokens here."""
CLAUDE_CONTEXT = 23_808
"""Engine context for Claude Code: its prompt measured 23,336 tiny-model tokens here (and
23,409 for the nudge it sends after an empty reply)."""
INSTALL_TIMEOUT_S = 300.0
"""`npm ci` of both CLIs (~0.8 GB) took ~30 s here."""
CLI_TIMEOUT_S = 300.0
"""A run: ~10-20 s a call (the prefill), then at most the room left, ~0.1 s a token."""
MODEL = "tiny-model"
TASK = "say hi"
REPLY = "hi"
# The shapes the gateway renders both CLIs' requests into: instructions, context messages,
# the task; Claude Code also puts a system message after the task.
HI_EXAMPLES = [
    (
        [
            {"role": "system", "content": "You are a coding agent. Run commands, read files."},
            {"role": "user", "content": "<environment_context>cwd: /work</environment_context>"},
            {"role": "user", "content": TASK},
        ],
        None,
        REPLY,
    ),
    (
        [
            {"role": "system", "content": "You are an agent for software engineering tasks."},
            {"role": "user", "content": TASK},
            {"role": "system", "content": "# Environment\nPrimary working directory: /work"},
        ],
        [
            {
                "type": "function",
                "function": {
                    "name": "Bash",
                    "description": "Run a shell command.",
                    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
                },
            }
        ],
        REPLY,
    ),
]


@pytest.fixture(scope="module")
def installed() -> None:
    """The CLIs at the versions of tests/harnesses/package-lock.json (`make harness-clis`)."""
    try:
        clis.install(INSTALL_TIMEOUT_S)
    except clis.CliMissingError as err:
        pytest.fail(str(err), pytrace=False)


@pytest.fixture(scope="module")
def hi_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, trained to answer the task with REPLY and end its turn."""
    return overfit(tmp_path_factory.mktemp("hi-model"), HI_EXAMPLES, steps=60)


@pytest.fixture
def codex(installed: None) -> Path:
    return clis.codex_binary()


@pytest.fixture
def claude(installed: None) -> Path:
    return clis.claude_binary()


@dataclass(frozen=True)
class Run:
    """A finished CLI process."""

    code: int
    stdout: str
    stderr: str

    def tail(self) -> str:
        out, err = self.stdout[-4000:], self.stderr[-8000:]
        return f"exit {self.code}\n--- stdout\n{out}\n--- stderr\n{err}"


async def run_cli(argv: list[str], env: dict[str, str], cwd: Path) -> Run:
    """Run a CLI to its end with stdin closed, in its own process group, which is killed
    when the run outlives CLI_TIMEOUT_S (the test then fails with its output) or the test
    is cancelled, so no tool process it started outlives the test."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    timed_out = False
    try:
        try:
            out, err = await asyncio.wait_for(process.communicate(), CLI_TIMEOUT_S)
        except TimeoutError:
            timed_out = True
            os.killpg(process.pid, signal.SIGKILL)
            out, err = await process.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):  # the whole group has already exited
            os.killpg(process.pid, signal.SIGKILL)
        if process.returncode is None:
            await process.wait()
    assert process.returncode is not None
    run = Run(process.returncode, out.decode(errors="replace"), err.decode(errors="replace"))
    if timed_out:
        pytest.fail(f"{Path(argv[0]).name} ran over {CLI_TIMEOUT_S:.0f}s\n{run.tail()}")
    return run


def requests_by_route(registry: CollectorRegistry) -> dict[tuple[str, str], int]:
    """harnessrl_gateway_requests as {(route, status): count}."""
    counts: dict[tuple[str, str], int] = {}
    for metric in registry.collect():
        for sample in metric.samples:
            if sample.name == "harnessrl_gateway_requests_total":
                key = (sample.labels["route"], sample.labels["status"])
                counts[key] = int(sample.value)
    return counts


async def assert_every_call_captured(
    stack: Stack, route: str, api: pb.Api.ValueType, run: Run
) -> list[pb.ModelCall]:
    """The calls the CLI made on `route` all succeeded, and each one is a ModelCall with
    seq 0..n-1, the right dialect and the token ids the engine saw and sampled; returned
    in seq order."""
    counts = requests_by_route(stack.registry)
    made = sum(n for (r, _), n in counts.items() if r == route)
    assert made >= 1, f"no call on {route}; requests seen: {counts}\n{run.tail()}"
    assert counts.get((route, "200"), 0) == made, f"failed calls: {counts}\n{run.tail()}"
    calls = await stack.calls(at_least=made)
    assert len(calls) == made, f"{made} calls on {route}, {len(calls)} ModelCalls"
    assert sorted(c.seq for c in calls) == list(range(made))
    for call in calls:
        assert call.api == api
        assert call.model == MODEL
        assert len(call.prompt_token_ids) > 0
        assert len(call.completion_token_ids) > 0
        assert len(call.completion_logprobs) == len(call.completion_token_ids)
    return sorted(calls, key=lambda c: c.seq)


def reply_text(model: Path, call: pb.ModelCall) -> str:
    """The text of a call's completion, as the engine decoded it for the harness."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = tokenizer.decode(list(call.completion_token_ids), skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence of ids decodes to one string
    return text.strip()


def base_env(home: Path, work: Path) -> dict[str, str]:
    """An environment that owns nothing of the developer's: no keys, no config, no HOME;
    creates `home` and the working directory `work`."""
    home.mkdir(parents=True)
    work.mkdir(parents=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}


def test_the_coding_agents_example_stack_has_room_for_both_clis() -> None:
    """README's recipe runs these CLIs on examples/coding-agents.yaml: its context must hold
    each one's prompt with the room these tests give (examples/up.yaml's 4,096 holds
    neither), and Codex, which sends no completion budget, must get the engine's default
    after its prompt."""
    from harnessrl.config import load_config
    from harnessrl.services.inference.config import InferenceConfig

    recipe = load_config(InferenceConfig, clis.REPO / "examples" / "coding-agents.yaml").inference
    assert recipe.max_model_len is not None
    assert recipe.max_model_len >= max(CODEX_CONTEXT, CLAUDE_CONTEXT)
    assert CODEX_CONTEXT + recipe.default_max_tokens <= recipe.max_model_len
    small = load_config(InferenceConfig, clis.REPO / "examples" / "up.yaml").inference
    assert small.max_model_len is None  # the tiny model's own 4,096 positions


async def test_codex_cli_default_agent_runs_through_the_gateway_and_is_captured(
    broker: EmbeddedBroker, tmp_path: Path, codex: Path, hi_model: Path
) -> None:
    async with running_stack(
        broker, tmp_path, hi_model, engine_settings={"max_model_len": CODEX_CONTEXT}
    ) as stack:
        token = stack.token()
        provider = (
            f'{{name="hrl",base_url="{stack.openai_base(token)}",env_key="HRL_API_KEY",'
            'wire_api="responses",request_max_retries=0,stream_max_retries=0}'
        )
        # Settings beyond the provider only keep it offline and non-interactive.
        settings = [
            f"model={MODEL}",
            "model_provider=hrl",
            f"model_providers.hrl={provider}",
            "approval_policy=never",
            "check_for_update_on_startup=false",
            "analytics.enabled=false",
            "otel.exporter=none",
            "otel.metrics_exporter=none",
            "otel.trace_exporter=none",
            "features.plugins=false",
            "features.apps=false",
        ]
        home = tmp_path / "home"
        work = tmp_path / "work"
        env = {**base_env(home, work), "CODEX_HOME": str(home), "HRL_API_KEY": token}
        argv = [str(codex), "exec", "--skip-git-repo-check", "--ephemeral", "--json"]
        argv += ["-s", "read-only"]
        for setting in settings:
            argv += ["-c", setting]
        run = await run_cli([*argv, TASK], env, work)
        assert run.code == 0, run.tail()
        events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        assert "turn.completed" in [e.get("type") for e in events], run.tail()
        calls = await assert_every_call_captured(
            stack, "/v1/responses", pb.API_OPENAI_RESPONSES, run
        )
        said = [
            e["item"].get("text", "").strip()
            for e in events
            if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"
        ]
        reply = reply_text(hi_model, calls[-1])
        assert not reply or said[-1:] == [reply], run.tail()


async def test_claude_code_default_agent_runs_through_the_gateway_and_is_captured(
    broker: EmbeddedBroker, tmp_path: Path, claude: Path, hi_model: Path
) -> None:
    async with running_stack(
        broker, tmp_path, hi_model, engine_settings={"max_model_len": CLAUDE_CONTEXT}
    ) as stack:
        token = stack.token()
        home, work = tmp_path / "home", tmp_path / "work"
        env = {
            **base_env(home, work),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "ANTHROPIC_BASE_URL": stack.anthropic_base(token),
            "ANTHROPIC_API_KEY": token,
            # No update checks, telemetry or error reports: there is no network here.
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        run = await run_cli([str(claude), "-p", "--model", MODEL, TASK], env, work)
        assert run.code == 0, run.tail()
        calls = await assert_every_call_captured(
            stack, "/v1/messages", pb.API_ANTHROPIC_MESSAGES, run
        )
        reply = reply_text(hi_model, calls[-1])
        assert not reply or run.stdout.strip() == reply, run.tail()
