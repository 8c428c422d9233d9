"""The production demo: a help desk's own traffic and its users' thumbs train its model.

Starts the stack with `harnessrl up --config examples/production/production.yaml` (no
controller, no task file), starts the help desk (app.py) against it with one base URL and
its app key, and lets the simulated users (users.py) ask and press thumbs for `--minutes`.
A progress line every 15 seconds; then one summary JSON line (the last line printed):

    {"greedy_early": ..., "greedy_late": ..., "sessions": ..., "feedback_coverage": ...,
     "feedback_delay_s": ..., "steps": ..., "minutes": ...}

greedy_early/late: the users' success rate on the conversations served exactly as the app
asked (not explored: temperature 0), in the first and the last fifth of them by time.
RUN_DIR gets report.json, report.png (success over time, token books), outcomes.jsonl (one
line per conversation), app.log and up.log.

    python -m examples.production.demo --minutes 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx
from examples.production.report import Measured, summarise, write_report
from examples.production.users import Behaviour, Outcome, run_users

if TYPE_CHECKING:
    from harnessrl.production import AppSpec

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "production" / "production.yaml"
APP_KEY = "hrl-demo-helpdesk-key-0123456789abcdef"
"""The help desk's key (production.yaml configures its SHA-256)."""
PROGRESS_S = 15.0


class DemoError(RuntimeError):
    """The demo could not run to its end; the message says where and why."""


async def run_demo(
    run_dir: Path, minutes: float, behaviour: Behaviour, progress: IO[str]
) -> dict[str, Any]:
    """Run it; returns the report's data (report.summarise), also written to run_dir."""
    from harnessrl.apps.up.attach import stack_for_run

    started = time.time()
    stack_cm = stack_for_run(
        run_dir, config=CONFIG, stack_file=None, progress=progress, error=DemoError
    )
    async with stack_cm as stack:
        stack_file = json.loads((run_dir / "stack" / "stack.json").read_text())
        gateway, feedback = stack_file["gateway"]["url"], stack_file["feedback_url"]
        outcomes: list[Outcome] = []
        async with help_desk(gateway, feedback, run_dir / "app.log") as app_url:
            progress.write(f"help desk at {app_url}; {behaviour.users} users for {minutes} min\n")
            ticker = asyncio.create_task(_progress(outcomes, stack.urls["trainer"], progress))
            try:
                await run_users(app_url, minutes * 60, behaviour, on_outcome=outcomes.append)
            finally:
                ticker.cancel()
        journal = run_dir / "stack" / "trainer" / "steps.jsonl"
        measured = await measure(stack.bootstrap, stack.urls, journal)
    with (run_dir / "outcomes.jsonl").open("w") as out:
        out.writelines(json.dumps(asdict(o)) + "\n" for o in outcomes)
    app = _app()
    report = summarise(
        outcomes, measured, app=app.name, share=app.exploration, started=started, ended=time.time()
    )
    write_report(report, run_dir)
    return report


@contextlib.asynccontextmanager
async def help_desk(gateway: str, feedback: str, log_path: Path) -> AsyncIterator[str]:
    """The help desk app (app.py) in its own process, as its team would deploy it; its URL.
    Stopped (SIGINT, then SIGKILL after 10 s) on the way out."""
    from harnessrl.broker import free_ports

    (port,) = free_ports(1)
    env = {
        **os.environ,
        "OPENAI_BASE_URL": f"{gateway}/v1",
        "OPENAI_API_KEY": APP_KEY,
        "FEEDBACK_URL": feedback,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with log_path.open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "examples.production.app", "--port", str(port),
            cwd=ROOT, env=env, stdout=log_file, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as client:
            for _ in range(300):
                if process.returncode is not None:
                    raise DemoError(f"the help desk exited: see {log_path}")
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"{url}/openapi.json")).status_code == 200:
                        break
                await asyncio.sleep(0.1)
            else:
                raise DemoError(f"the help desk did not start in 30 s: see {log_path}")
        yield url
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _progress(outcomes: list[Outcome], trainer: str, out: IO[str]) -> None:
    """A line every PROGRESS_S: conversations, recent success, thumbs, trainer steps."""
    begun = time.time()
    while True:
        await asyncio.sleep(PROGRESS_S)
        now = time.time()
        recent = [o for o in outcomes if o.answered_at > now - 60]
        rate = sum(o.correct for o in recent) / len(recent) if recent else 0.0
        thumbs = sum(o.thumbs is not None for o in outcomes)
        steps = (await _counters(trainer)).get("harnessrl_trainer_steps_total", {}).get("", 0)
        out.write(
            f"  {(now - begun) / 60:4.1f} min  conversations {len(outcomes):5d}  "
            f"success (last minute) {rate:.2f}  thumbs {thumbs:5d}  steps {int(steps)}\n"
        )
        out.flush()


async def _counters(base_url: str) -> dict[str, dict[str, float]]:
    """Counter samples of a service's /metrics: name -> joined label values -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            text = (await client.get(f"{base_url}/metrics")).text
    except httpx.HTTPError:
        return {}
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, {})[",".join(sample.labels.values())] = sample.value
    return found


async def measure(bootstrap: str, urls: dict[str, str], journal: Path) -> Measured:
    """What the stack did with the app's sessions: their calls' completion tokens
    (hrl.calls), the sample builder's books (its /metrics), the trained sessions' samples
    (hrl.samples), the trainer's dropped tokens (its /metrics) and the steps of its journal
    that count as trained (a rewind's retired versions' too)."""
    from harnessrl import events
    from harnessrl.bus.snapshot import read_to_end
    from harnessrl.config import KafkaSettings
    from harnessrl.services.trainer.journal import read, trained
    from harnessrl.v1 import events_pb2 as pb

    await asyncio.sleep(5.0)  # the last decided sessions reach the trainer
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    calls: dict[tuple[str, int], int] = {}
    async for _, event, _ in read_to_end(kafka, events.CALLS, client_id="production-demo"):
        if isinstance(event, pb.ModelCall) and event.group_id.startswith("s."):
            calls[(event.episode_id, event.seq)] = len(event.completion_token_ids)
    groups: dict[str, pb.GroupSamples] = {}
    async for _, event, _ in read_to_end(kafka, events.SAMPLES, client_id="production-demo"):
        if isinstance(event, pb.GroupSamples) and event.group_id.startswith("s."):
            groups[event.group_id] = event  # a re-publication is byte for byte the same
    builder = await _counters(urls["sample-builder"])
    trainer = await _counters(urls["trainer"])
    return Measured(
        captured=sum(calls.values()),
        builder=builder.get("harnessrl_samples_completion_tokens_total", {}),
        groups=list(groups.values()),
        trainer_dropped=trainer.get("harnessrl_trainer_tokens_dropped_total", {}),
        steps=trained(read(journal)),
    )


def _app() -> AppSpec:
    from harnessrl.config import load_config
    from harnessrl.services.gateway.config import GatewayConfig

    return load_config(GatewayConfig, CONFIG).production.apps[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=5.0, help="how long users ask")
    parser.add_argument("--users", type=int, default=8, help="users asking at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    run_dir = args.run_dir or ROOT / "runs" / f"production-{datetime.now():%Y%m%d-%H%M%S}"
    behaviour = Behaviour(users=args.users, seed=args.seed)
    try:
        report = asyncio.run(run_demo(run_dir, args.minutes, behaviour, sys.stderr))
    except DemoError as err:
        sys.stderr.write(f"demo-production: {err}\n")
        raise SystemExit(1) from None
    sys.stderr.write(f"report: {run_dir / 'report.png'}, {run_dir / 'report.json'}\n")
    sys.stdout.write(json.dumps(report["summary"]) + "\n")


if __name__ == "__main__":
    main()
