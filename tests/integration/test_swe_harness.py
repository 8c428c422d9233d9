"""mini-swe-agent, unmodified, as the coding harness (examples/swe), through the real stack.

The real controller runs `examples/swe/launch.py` for a task on a tiny repository made here
(a function with a bug, its tests), on the real broker, its calls through the real gateway.
The launcher makes the episode's working copy and runs mini-swe-agent's `mini` command, as
installed by `python examples/swe/install.py` (its own venv, from the hash-locked
requirements; the fixture runs it, and the tests are skipped, saying why, when it cannot
install). What is checked is what a user relies on: every model call mini made reached the
gateway and is a ModelCall with token ids; its commands ran in the working copy with the
task's venv first on PATH; the patch in the result is what the agent did, new files
included, and the built-in `tests` reward scores it 1; the task's repository is untouched;
no harness process went anywhere on the network but the gateway (litellm fetches its cost
map from the internet unless the launcher tells it not to); a run cut at its step limit
still reports its patch; a bad task is refused naming the field.

The engine is a stand-in (tests/swe_standin.py) playing a fixed script of bash commands:
a model that had to find the fix would make the test about the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from harnessrl import events
from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import Producer
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from harnessrl.runtime import Runtime
from harnessrl.services.controller.config import ControllerConfig, ControllerSection, HarnessSpec
from harnessrl.services.controller.service import ControllerService
from harnessrl.services.gateway.config import GatewayConfig, GatewaySection
from harnessrl.services.gateway.service import GatewayService
from harnessrl.services.reward import config as reward_config
from harnessrl.services.reward import patch_tests
from harnessrl.services.reward.episode import Episode
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import FAST_GROUP, eventually
from tests.integration.gateway_stack import ADMIN, SECRET
from tests.integration.test_harness_clis import requests_by_route
from tests.repo_helpers import PYTEST, git, make_repo, patch_for
from tests.swe_standin import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "examples" / "swe" / "install.py"
LAUNCH = ROOT / "examples" / "swe" / "launch.py"
NET_AUDIT = ROOT / "tests" / "net_audit"
INSTALL_TIMEOUT_S = 480.0
"""`install.py` into an empty venv: ~80 s here (~750 MB); a no-op once installed."""
RUN_TIMEOUT_S = 120.0
"""A run: ~6 s of importing litellm, then two calls and two commands."""

CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = (
    "from calc import add, mul\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_mul():\n    assert mul(2, 3) == 6\n"
)
NOTE = "add() adds now.\n"
PROBLEM = "add(2, 3) returns -1 instead of 5."
TEST_COMMAND = "python -m pytest tests"
SCRIPT = [
    # One step that fixes the bug, adds a file, shows which python runs and runs the tests.
    "sed -i 's/a - b/a + b/' calc.py && printf 'add() adds now.\\n' > NOTES.txt"
    " && command -v python"
    " && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q -p no:cacheprovider tests",
    # mini-swe-agent's way of ending a task (its default config's instructions).
    "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT",
]
MODEL = "policy"
"""What the launcher's default `--model openai/policy` sends (litellm drops the provider)."""


@pytest.fixture(scope="module")
def mini() -> Path:
    """mini-swe-agent's `mini`, installed by the documented command."""
    try:
        done = subprocess.run(
            [sys.executable, str(INSTALL)],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"`python {INSTALL}` took over {INSTALL_TIMEOUT_S:.0f}s")
    if done.returncode != 0:
        pytest.skip(f"mini-swe-agent could not be installed: {done.stderr[-1500:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass
class Gateway:
    url: str
    registry: CollectorRegistry


@asynccontextmanager
async def gateway_before(
    broker: EmbeddedBroker, tmp_path: Path, engine: ScriptedEngine
) -> AsyncIterator[Gateway]:
    """The real gateway in this process, in front of `engine`."""
    registry = CollectorRegistry()
    config = GatewayConfig(
        instance="gw-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "gw-spill"),
        gateway=GatewaySection(
            port=0,
            token_secret=SecretStr(SECRET),
            admin_token=SecretStr(ADMIN),
            engines=[engine.url],
        ),
    )
    service = GatewayService(config, Runtime("gateway", "gw-0", registry, TracerProvider()))
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield Gateway(f"http://127.0.0.1:{service.port}", registry)
    finally:
        await service.stop()
        await task


@asynccontextmanager
async def controller(
    broker: EmbeddedBroker, tmp_path: Path, gateway_url: str, harness: HarnessSpec
) -> AsyncIterator[None]:
    """The real controller in this process, running `harness` with the local runner."""
    section = ControllerSection(
        harness=harness,
        gateway_url=gateway_url,
        token_secret=SecretStr(SECRET),
        admin_token=SecretStr(ADMIN),
        workdir=tmp_path / "episodes",
        state_dir=tmp_path / "controller",
        max_attempts=1,
        kill_grace_s=1.0,
        inherit_env=["PATH", "HOME", "LANG"],
        port=0,
    )
    config = ControllerConfig(
        instance="ctl-0",
        kafka=KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3),
        consumer=ConsumerSettings(**FAST_GROUP),
        producer=ProducerSettings(spill_dir=tmp_path / "ctl-spill"),
        controller=section,
    )
    service = ControllerService(
        config, Runtime("controller", "ctl-0", CollectorRegistry(), TracerProvider())
    )
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    try:
        yield
    finally:
        await service.stop()
        await task


async def submit(broker: EmbeddedBroker, tmp_path: Path, task: pb.TaskSubmitted) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=broker.bootstrap),
        ProducerSettings(spill_dir=tmp_path / "submit"),
        name="submit/t",
    )
    await producer.start()
    await producer.publish(task)
    await producer.stop()


async def topic(broker: EmbeddedBroker, name: str) -> list[tuple[str, Any]]:
    """(kind, event) of every record on a topic, in order."""
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    return [(kind, event) async for kind, event, _ in read_to_end(kafka, name, client_id="t")]


async def final_episode(broker: EmbeddedBroker) -> pb.EpisodeFinished:
    found: list[pb.EpisodeFinished] = []

    async def finished() -> bool:
        found[:] = [e for k, e in await topic(broker, events.EPISODES) if k == "episode_finished"]
        return any(e.final for e in found)

    # Past the harness timeout: a run killed there is still reported.
    await eventually(finished, timeout=RUN_TIMEOUT_S + 30, interval=0.5)
    return next(e for e in found if e.final)


def network_log(path: Path) -> list[tuple[str, str, int]]:
    """(event, host, port) of every lookup and connect the harness's processes made."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["event"], r["host"], int(r["port"])) for r in lines]


@dataclass
class Ran:
    """A finished episode, and what the gateway counted of it."""

    finished: pb.EpisodeFinished
    run_dir: Path
    requests: dict[tuple[str, str], int]
    """The gateway's count of harness requests by (route, status)."""
    gateway: tuple[str, int]
    """The gateway's address (host, port)."""

    def logs(self) -> str:
        return "\n".join(
            f"--- {name}\n{(self.run_dir / name).read_text()[-6000:]}"
            for name in ("stdout.log", "stderr.log")
            if (self.run_dir / name).exists()
        )


async def run_episode(
    broker: EmbeddedBroker,
    tmp_path: Path,
    engine: ScriptedEngine,
    harness: HarnessSpec,
    task: pb.TaskSubmitted,
) -> Ran:
    """Submit `task` to a controller running `harness` through the gateway in front of
    `engine`; the episode once it is final."""
    async with (
        gateway_before(broker, tmp_path, engine) as gateway,
        controller(broker, tmp_path, gateway.url, harness),
    ):
        await submit(broker, tmp_path, task)
        finished = await final_episode(broker)
        run_dir = Episode.from_event(finished).artifacts_dir
        assert run_dir is not None, finished
        counted = len(engine.requests)

        def harness_requests() -> dict[tuple[str, str], int]:
            counts = requests_by_route(gateway.registry).items()
            return {key: n for key, n in counts if key[0].startswith("/v1/")}

        await eventually(lambda: sum(harness_requests().values()) >= counted)
        host, port = gateway.url.removeprefix("http://").split(":")
        return Ran(finished, run_dir, harness_requests(), (host, int(port)))


def coding_task(tmp_path: Path) -> tuple[Path, str, pb.TaskSubmitted]:
    """The task's repository, its base commit, and the task as submitted."""
    repo = tmp_path / "task-repo"
    base = make_repo(repo, {"calc.py": CALC, "tests/test_calc.py": TESTS, "pytest.ini": ""})
    task_input = {
        "problem_statement": PROBLEM,
        "repo": str(repo),
        "base_commit": base,
        "environment": sys.prefix,  # this venv: it has pytest, mini-swe-agent's has not
        "test_command": TEST_COMMAND,
    }
    metadata = {
        "repo": str(repo),
        "base_commit": base,
        "test_command": [*PYTEST, "--junitxml={junit_xml}", "tests"],
        "tests": ["tests/test_calc.py::test_add", "tests/test_calc.py::test_mul"],
        "protected_paths": ["tests"],
    }
    task = pb.TaskSubmitted(
        task_id="calc-add",
        group_id="g-calc",
        split=pb.MODE_VAL,
        input_json=json.dumps(task_input),
        group_size=1,
        metadata_json=json.dumps(metadata),
    )
    return repo, base, task


async def assert_every_call_captured(broker: EmbeddedBroker, ran: Ran, made: int) -> None:
    """The harness's `made` calls all succeeded at the gateway, and each is a ModelCall of
    the episode with seq 0..made-1 and the engine's token ids; the close counted them."""
    assert ran.requests == {("/v1/chat/completions", "200"): made}, ran.requests
    records = await topic(broker, events.CALLS)
    episode = ran.finished.episode_id
    calls = [e for k, e in records if k == "model_call" and e.episode_id == episode]
    assert sorted(c.seq for c in calls) == list(range(made))
    for call in calls:
        assert call.api == pb.API_OPENAI_CHAT and call.model == MODEL
        assert len(call.prompt_token_ids) > 0 and len(call.completion_token_ids) > 0
        assert len(call.completion_logprobs) == len(call.completion_token_ids)
    assert [e.call_count for k, e in records if k == "episode_closed"] == [made]


async def test_mini_swe_agent_fixes_a_bug_through_the_gateway_and_its_patch_passes_the_tests(
    broker: EmbeddedBroker, tmp_path: Path, mini: Path
) -> None:
    repo, base, task = coding_task(tmp_path)
    audit = tmp_path / "network.jsonl"
    harness = HarnessSpec(
        command=[sys.executable, str(LAUNCH), f"--mini={mini}", "--step-limit=5"],
        timeout_s=RUN_TIMEOUT_S,
        env={
            "PYTHONPATH": str(NET_AUDIT),
            "NET_AUDIT_LOG": str(audit),
            # A failed call fails the run at once, not after mini's ten backed-off retries.
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
        },
    )
    engine = ScriptedEngine(SCRIPT, model=MODEL)
    await engine.start()
    try:
        ran = await run_episode(broker, tmp_path, engine, harness, task)
    finally:
        await engine.stop()
    finished = ran.finished
    assert finished.status == pb.EPISODE_STATUS_SUCCEEDED, f"{finished}\n{ran.logs()}"
    assert finished.exit_code == 0, ran.logs()
    await assert_every_call_captured(broker, ran, len(SCRIPT))

    # mini was given the task, and its first command ran in the working copy with the
    # task's venv first on PATH.
    assert len(engine.requests) == len(SCRIPT)
    first = engine.requests[0]["messages"]
    assert PROBLEM in first[1]["content"] and TEST_COMMAND in first[1]["content"]
    observation = engine.requests[1]["messages"][-1]
    assert observation["role"] == "tool"
    assert f"{sys.prefix}/bin/python" in observation["content"], observation
    assert "2 passed" in observation["content"], observation

    # The result is the agent's patch, and mini's own account of the run.
    result = json.loads(finished.result_json)
    fixed = {"calc.py": CALC.replace("a - b", "a + b"), "NOTES.txt": NOTE}
    expected = patch_for(repo, tmp_path / "expected", fixed)
    assert result["patch"] == expected
    assert (ran.run_dir / "patch.diff").read_text() == expected
    assert (result["exit_status"], result["model_calls"], result["base_commit"]) == (
        "Submitted",
        len(SCRIPT),
        base,
    )
    trajectory = json.loads((ran.run_dir / "trajectory.json").read_text())
    assert trajectory["info"]["exit_status"] == "Submitted"

    # The reward service's built-in `tests` reward scores it as it would.
    settings = reward_config.TestsSettings(scratch_dir=tmp_path / "scratch", kill_grace_s=0.5)
    score = await patch_tests.TestsReward(settings)(Episode.from_event(finished))
    assert score.value == 1.0, score.message

    # The task's repository was only read.
    assert git(repo, "status", "--porcelain") == ""
    assert git(repo, "rev-parse", "HEAD").strip() == base

    # The harness's processes went nowhere but the gateway.
    seen = network_log(audit)
    assert ("socket.connect", *ran.gateway) in seen, seen
    assert {(host, port) for _, host, port in seen} == {ran.gateway}, seen


async def test_a_run_cut_at_its_step_limit_still_reports_its_patch(
    tmp_path: Path, mini: Path
) -> None:
    """Run by hand (no $HARNESSRL_OUTPUT), straight at the engine: the result is the last
    stdout line, and an agent that never submits still leaves its work to be scored."""
    repo, base, task = coding_task(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    engine = ScriptedEngine(SCRIPT[:1], model=MODEL)  # never submits
    await engine.start()
    try:
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(tmp_path),
            "HARNESSRL_TASK": task.input_json,
            "OPENAI_BASE_URL": f"{engine.url}/v1",
            "OPENAI_API_KEY": "unused",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
        }
        argv = [sys.executable, str(LAUNCH), f"--mini={mini}", "--step-limit=1"]
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=run_dir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT_S)
    finally:
        await engine.stop()
    logs = f"{out.decode()[-4000:]}\n--- stderr\n{err.decode()[-4000:]}"
    assert process.returncode == 0, logs
    last = out.decode().splitlines()[-1]
    assert last.startswith("HARNESSRL_RESULT "), logs
    result = json.loads(last.removeprefix("HARNESSRL_RESULT "))
    assert (result["exit_status"], result["model_calls"]) == ("LimitsExceeded", 1)
    assert len(engine.requests) == 1
    fixed = {"calc.py": CALC.replace("a - b", "a + b"), "NOTES.txt": NOTE}
    assert result["patch"] == patch_for(repo, tmp_path / "expected", fixed)
    assert result["base_commit"] == base


@pytest.mark.parametrize(
    ("task", "field"),
    [
        ({"repo": "/r", "base_commit": "abc"}, "input.problem_statement"),
        ({"problem_statement": "p", "repo": "relative/path", "base_commit": "abc"}, "input.repo"),
        ({"problem_statement": "p", "repo": "REPO", "base_commit": "nope"}, "input.base_commit"),
        (
            {"problem_statement": "p", "repo": "REPO", "base_commit": "HEAD", "environment": "/x"},
            "input.environment",
        ),
    ],
    ids=["no-problem-statement", "relative-repo", "unknown-commit", "no-such-venv"],
)
def test_the_launcher_refuses_a_bad_task_naming_the_field(
    tmp_path: Path, task: dict[str, Any], field: str
) -> None:
    """Checked before anything runs: exit 2, nothing made in the run's directory."""
    repo = tmp_path / "repo"
    make_repo(repo, {"a.py": "A = 1\n"})
    if task.get("repo") == "REPO":
        task["repo"] = str(repo)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"PATH": os.environ["PATH"], "HARNESSRL_TASK": json.dumps(task)}
    done = subprocess.run(
        [sys.executable, str(LAUNCH)],
        cwd=run_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert field in done.stderr, done.stderr
    assert list(run_dir.iterdir()) == []
