"""The harness under docker-compose.yml's controller, as that file configures the container:
it cannot read the token secret or the admin token, reach the broker, or write a reward.

There is no Docker engine on the machines this is tested on, so the container's configuration
is read from docker-compose.yml and reproduced: the real `harnessrl gateway` and `harnessrl
controller` processes, each with exactly the environment Compose gives its container (its
/run/secrets files and /var/lib/harnessrl volumes mapped to temporary paths, the broker and
the engine to this test's), the controller as the user Compose runs it as (root). A harness
that hunts for the secrets (every process's environment and command line it can see, every
file under the places secrets live), dials the broker and calls the gateway's admin API runs
as the controller runs every harness, and reports what it got. What Docker adds on top (its
own namespaces, seccomp, AppArmor) is not reproduced; the sandbox is what stands between a
harness and the controller inside the container.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnessrl import events
from harnessrl.bench import calculator_standin
from harnessrl.broker import EmbeddedBroker, free_ports
from harnessrl.bus import Producer
from harnessrl.bus.snapshot import read_to_end
from harnessrl.config import KafkaSettings, ProducerSettings
from harnessrl.v1 import events_pb2 as pb
from tests.helpers import eventually
from tests.unit.test_compose import SECRETS, compose, environment

pytestmark = pytest.mark.integration

PROBE = Path(__file__).resolve().parents[1] / "harnesses" / "secret_probe_harness.py"


def _as_root() -> None:
    if os.geteuid() != 0:
        reason = "the compose controller runs as root; this machine's tests do not"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def _container_env(
    service: dict[str, Any], tmp: Path, overrides: dict[str, str]
) -> tuple[dict[str, str], dict[str, Path]]:
    """The service's container environment, with its Compose secrets written as files (mode
    0400, root's) and /run/secrets and /var/lib/harnessrl mapped under `tmp`; and the
    secret files (container path -> path here)."""
    secrets = {}
    for name in service.get("secrets", []):
        source = compose()["secrets"][name]["environment"]
        path = tmp / "run-secrets" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SECRETS[source] + "\n")
        path.chmod(0o400)
        secrets[f"/run/secrets/{name}"] = path
    env = {key: _mapped(value, secrets, tmp) for key, value in environment(service).items()}
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp / "home"), "LANG": "C.UTF-8"}
    return base | env | overrides, secrets


def _mapped(value: str, secrets: dict[str, Path], tmp: Path) -> str:
    if value in secrets:
        return str(secrets[value])
    if value.startswith("/var/lib/harnessrl"):
        return str(tmp / value.lstrip("/"))
    return value


@contextmanager
def _process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=out)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


async def _healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    async with httpx.AsyncClient() as http:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert process.poll() is None, _tail(log)
            try:
                if (await http.get(f"{url}/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never healthy:\n{_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text()[-4000:]


async def test_a_harness_under_the_compose_controller_reaches_no_secret_no_broker_no_reward(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    _as_root()
    data = compose()
    controller_service, gateway_service = (
        data["services"]["controller"],
        data["services"]["gateway"],
    )
    assert controller_service["user"] == "0:0"
    engine_port, gateway_port, controller_port = free_ports(3)
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    gateway_env, _ = _container_env(
        gateway_service,
        tmp_path / "gateway",
        {
            "HARNESSRL_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap,
            "HARNESSRL_TELEMETRY__EXPORTER": "none",
            "HARNESSRL_GATEWAY__HOST": "127.0.0.1",
            "HARNESSRL_GATEWAY__PORT": str(gateway_port),
            "HARNESSRL_GATEWAY__ENGINES": json.dumps([f"http://127.0.0.1:{engine_port}"]),
        },
    )
    controller_env, secret_files = _container_env(
        controller_service,
        tmp_path / "controller",
        {
            "HARNESSRL_KAFKA__BOOTSTRAP_SERVERS": broker.bootstrap,
            "HARNESSRL_TELEMETRY__EXPORTER": "none",
            "HARNESSRL_CONTROLLER__HOST": "127.0.0.1",
            "HARNESSRL_CONTROLLER__PORT": str(controller_port),
            "HARNESSRL_CONTROLLER__GATEWAYS": json.dumps(
                [{"name": "gateway-0", "url": gateway_url}]
            ),
            # the one change to the compose file: this harness instead of the calculator's
            "HARNESSRL_CONTROLLER__HARNESS__COMMAND": json.dumps([sys.executable, str(PROBE)]),
        },
    )
    # What Compose gives the container: the secrets as root-only files, none in its environment.
    assert controller_env["HARNESSRL_CONTROLLER__SANDBOX__MODE"] == "bwrap"
    assert not any(s in " ".join(controller_env.values()) for s in SECRETS.values())
    assert {p.read_text().strip() for p in secret_files.values()} == set(SECRETS.values())
    standin = multiprocessing.get_context("spawn").Process(
        target=calculator_standin.serve, args=(engine_port,), daemon=True
    )
    standin.start()
    harnessrl = [sys.executable, "-m", "harnessrl"]
    try:
        with (
            _process(
                [*harnessrl, *gateway_service["command"]], gateway_env, tmp_path / "gw.log"
            ) as gw,
            _process(
                [*harnessrl, *controller_service["command"]], controller_env, tmp_path / "ctl.log"
            ) as ctl,
        ):
            await _healthy(gateway_url, gw, tmp_path / "gw.log")
            await _healthy(f"http://127.0.0.1:{controller_port}", ctl, tmp_path / "ctl.log")
            # The controller's own environment holds no secret either (it reads files).
            environ = await asyncio.to_thread(Path(f"/proc/{ctl.pid}/environ").read_bytes)
            assert not any(s.encode() in environ for s in SECRETS.values())
            task = {
                "secret_digests": [
                    hashlib.sha256(s.encode()).hexdigest() for s in SECRETS.values()
                ],
                "secret_roots": ["/run", "/var/lib", str(tmp_path), "/etc", "/tmp"],
                "read": [
                    *(str(p) for p in secret_files.values()),
                    f"/proc/{ctl.pid}/environ",
                    "/proc/1/environ",
                ],
                "broker": [[host, int(port)] for host, port in [broker.bootstrap.rsplit(":", 1)]],
                "episode": "an-episode-of-another-harness",
            }
            await _submit(broker.bootstrap, tmp_path, task)
            finished = await _finished(broker.bootstrap)
    finally:
        standin.terminate()
        standin.join(10)

    assert finished.status == pb.EPISODE_STATUS_SUCCEEDED, (
        finished.reason,
        _tail(tmp_path / "ctl.log"),
    )
    report = json.loads(finished.result_json)
    assert report["own_environment"] is False
    assert report["processes"]["holding_a_secret"] == []
    assert report["files"]["holding_a_secret"] == []
    assert all(outcome != "ok" for outcome in report["reads"].values()), report["reads"]
    assert all(outcome != "ok" for outcome in report["broker"].values()), report["broker"]
    assert report["uid"] != 0  # a uid of its own, not the controller's root
    # It reaches the gateway, and only as a harness: the admin API refuses it.
    assert report["gateway_models"] == 200, report
    assert report["admin_close_without_token"] == 401, report
    assert report["admin_close_with_the_episode_token"] == 401, report
    # No reward was written (the broker was out of reach; no reward service runs here).
    kafka = KafkaSettings(bootstrap_servers=broker.bootstrap)
    rewards = [e async for e in read_to_end(kafka, events.REWARDS, client_id="rewards-check")]
    assert rewards == []


async def _submit(bootstrap: str, tmp_path: Path, task: dict[str, Any]) -> None:
    producer = Producer(
        KafkaSettings(bootstrap_servers=bootstrap),
        ProducerSettings(spill_dir=tmp_path / "submit"),
        name="submit/t",
    )
    await producer.start()
    try:
        await producer.publish(
            pb.TaskSubmitted(
                task_id="probe",
                group_id="g-probe",
                split=pb.MODE_TRAIN,
                input_json=json.dumps(task),
                group_size=1,
                metadata_json="{}",
            )
        )
    finally:
        await producer.stop()


async def _finished(bootstrap: str) -> pb.EpisodeFinished:
    kafka = KafkaSettings(bootstrap_servers=bootstrap)
    found: list[pb.EpisodeFinished] = []

    async def done() -> bool:
        async for kind, event, _ in read_to_end(kafka, events.EPISODES, client_id="probe-done"):
            if kind == "episode_finished" and event.final:  # type: ignore[attr-defined]
                found.append(event)  # type: ignore[arg-type]
        return bool(found)

    await eventually(done, timeout=180, interval=0.5)
    return found[0]
