"""What `harnessrl up` runs: one child per service, wired to each other by environment.

Every child reads the same config file; the environment overrides only what must be shared
or must not collide: the broker address, the telemetry endpoint, each service's port, the
gateway/controller secrets and the state directories under the work directory.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from harnessrl import registry
from harnessrl.apps.up.stackfile import GatewayAccess
from harnessrl.broker import free_ports
from harnessrl.config import load_config

if TYPE_CHECKING:
    from harnessrl.services.controller.config import ControllerSection
    from harnessrl.services.gateway.config import GatewaySection

LOCALHOST = "127.0.0.1"


class UpError(RuntimeError):
    """The stack could not be planned or started; the message says which part and why."""


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One service process: how to start it and how to tell it is ready."""

    name: str
    """Service name, as `harnessrl <name>` and as printed in the merged log."""
    argv: tuple[str, ...]
    env: dict[str, str]
    """Variables set on top of `up`'s own environment."""
    health_url: str
    """GET answers 200 once the service is ready."""
    address: str
    """Where the service listens, for the table printed once all are ready."""


@dataclass(frozen=True, slots=True)
class StackPlan:
    bootstrap: str
    """Kafka bootstrap servers of the embedded broker."""
    gateway: GatewayAccess
    """Where the gateway listens and the secrets it was started with."""
    children: tuple[ChildSpec, ...] = field(default=())
    """In start order; stopped in reverse."""
    config: Path | None = None
    """The config file every child reads (None: the defaults)."""
    feedback_url: str | None = None
    """Base URL of the reward service's feedback API (`POST <url>/v1/feedback`), where
    production apps send their users' feedback; None when production.apps is not set."""


def build_plan(
    config_file: Path | None,
    workdir: Path,
    telemetry_endpoint: str,
    without: frozenset[str] = frozenset(),
) -> StackPlan:
    """Plan the stack, leaving out the services named in `without` (only those in
    OPTIONAL: a stack that only runs episodes needs no trainer). A production stack
    (production.apps set, no controller.harness) runs without the controller: its traffic
    is the apps' own. Ports are picked free now (the feedback API's too); secrets the config
    leaves unset are generated for this run (`StackPlan.gateway` carries them, for the stack
    file). Raises UpError when the config names neither a harness command nor production
    apps or `without` names a service that cannot be left out, or
    pydantic.ValidationError / FileNotFoundError for a bad config."""
    if not without <= OPTIONAL:
        names = ", ".join(sorted(without - OPTIONAL))
        raise UpError(f"--without {names}: only {', '.join(sorted(OPTIONAL))} can be left out")
    from harnessrl.services.controller.config import ControllerConfig
    from harnessrl.services.gateway.config import GatewayConfig

    controller = load_config(ControllerConfig, config_file).controller
    gateway_config = load_config(GatewayConfig, config_file)
    gateway, production = gateway_config.gateway, gateway_config.production
    if controller.harness is None and not production.apps:
        raise UpError(
            "controller.harness is not set: name the harness command in the config "
            "(or production.apps, for a stack that serves production apps alone)"
        )
    if controller.harness is None:
        without = without | {"controller"}
    # Every port distinct: picked one at a time, the kernel may hand out the same one twice.
    kafka_port, weightsync_port, admin_port, feedback_port, *service_ports = free_ports(
        4 + len(_SERVICES)
    )
    bootstrap = f"{LOCALHOST}:{kafka_port}"
    ports = dict(zip(_SERVICES, service_ports, strict=True))
    shared = _shared_env(bootstrap, telemetry_endpoint, workdir)
    if production.store == _DEFAULT_STORE:  # a configured store is kept where it is
        shared["HARNESSRL_PRODUCTION__STORE"] = str(workdir / "sessions")
    feedback_url = _url(feedback_port) if production.apps else None
    base = [sys.executable, "-m", "harnessrl"]
    config_args = ["--config", str(config_file)] if config_file is not None else []
    access = _gateway_access(gateway, controller, ports["gateway"], admin_port)
    separate_admin = access.admin_url != access.url
    per_service: dict[str, dict[str, str]] = {
        "broker": {},
        "inference": {},
        "gateway": {
            "HARNESSRL_GATEWAY__ENGINES": json.dumps([_url(ports["inference"])]),
            "HARNESSRL_GATEWAY__TOKEN_SECRET": access.token_secret,
            "HARNESSRL_GATEWAY__ADMIN_TOKEN": access.admin_token,
            **({"HARNESSRL_GATEWAY__ADMIN_PORT": str(admin_port)} if separate_admin else {}),
        },
        "reward": {"HARNESSRL_REWARD__FEEDBACK_PORT": str(feedback_port)} if feedback_url else {},
        "sample-builder": {},
        "trainer": {
            "HARNESSRL_TRAINER__WEIGHTSYNC__PORT": str(weightsync_port),
            "HARNESSRL_TRAINER__CHECKPOINT_DIR": str(workdir / "trainer"),
        },
        "controller": {
            "HARNESSRL_CONTROLLER__GATEWAY_URL": access.url,
            "HARNESSRL_CONTROLLER__GATEWAY_ADMIN_URL": access.admin_url,
            "HARNESSRL_CONTROLLER__TOKEN_SECRET": access.token_secret,
            "HARNESSRL_CONTROLLER__ADMIN_TOKEN": access.admin_token,
            "HARNESSRL_CONTROLLER__WORKDIR": str(workdir / "episodes"),
            "HARNESSRL_CONTROLLER__STATE_DIR": str(workdir / "controller"),
        }
        | _harness_env(controller),
    }
    children = []
    for name, section in _SERVICES.items():
        if name in without:
            continue
        extra = ["--port", str(kafka_port)] if name == "broker" else []
        port = ports[name]
        env = {**shared, f"HARNESSRL_{section}__PORT": str(port), **per_service[name]}
        children.append(
            ChildSpec(
                name=name,
                argv=(*base, name, *extra, *config_args),
                env=env,
                health_url=f"{_url(port)}/healthz",
                address=_address(name, port, bootstrap, feedback_url),
            )
        )
    return StackPlan(
        bootstrap=bootstrap,
        gateway=access,
        children=tuple(children),
        config=config_file.resolve() if config_file is not None else None,
        feedback_url=feedback_url,
    )


def _harness_env(controller: ControllerSection) -> dict[str, str]:
    if controller.harness is None:
        return {}
    command = resolve_command(controller.harness.command)
    return {"HARNESSRL_CONTROLLER__HARNESS__COMMAND": json.dumps(command)}


_SERVICES = {spec.name: spec.env_section for spec in registry.started_by_up()}
"""Service (CLI command) -> its config section's environment name, in start order."""

OPTIONAL = registry.optional()
"""Services a stack can run without: episodes are still run, captured and rewarded."""

_DEFAULT_STORE = Path(".harnessrl/sessions")
"""production.store's default, which `up` moves into its work directory."""


def resolve_command(command: list[str]) -> list[str]:
    """The harness command with arguments that name existing relative files made absolute:
    the controller runs the harness in each episode's own directory, so a path written
    relative to where `up` starts would not be found there."""
    return [str(Path(arg).resolve()) if _relative_file(arg) else arg for arg in command]


def _relative_file(arg: str) -> bool:
    path = Path(arg)
    return not path.is_absolute() and "/" in arg and path.is_file()


def _shared_env(bootstrap: str, telemetry_endpoint: str, workdir: Path) -> dict[str, str]:
    # The venv's bin first on PATH, so a harness command "python" is this interpreter.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return {
        "PATH": path,
        "PYTHONUNBUFFERED": "1",
        "HARNESSRL_KAFKA__BOOTSTRAP_SERVERS": bootstrap,
        "HARNESSRL_TELEMETRY__EXPORTER": "otlp-grpc",
        "HARNESSRL_TELEMETRY__ENDPOINT": telemetry_endpoint,
        "HARNESSRL_LOG__FORMAT": "json",  # up parses and re-renders each line
        "HARNESSRL_PRODUCER__SPILL_DIR": str(workdir / "spill"),
    }


def _gateway_access(
    gateway: GatewaySection, controller: ControllerSection, port: int, admin_port: int
) -> GatewayAccess:
    """The gateway's URLs and the secrets it shares with the controller: the config's, else
    generated for this run. The admin API has a port of its own (`admin_port`, picked free
    like every other) only when the config asks for one; otherwise it is on `port`."""
    url = _url(port)
    return GatewayAccess(
        url=url,
        admin_url=url if gateway.admin_port is None else _url(admin_port),
        token_secret=_secret(gateway.token_secret, controller.token_secret),
        admin_token=_secret(gateway.admin_token, controller.admin_token),
    )


def _secret(*configured: object) -> str:
    from pydantic import SecretStr

    for value in configured:
        if isinstance(value, SecretStr):
            return value.get_secret_value()
    return secrets.token_urlsafe(32)


def _url(port: int) -> str:
    return f"http://{LOCALHOST}:{port}"


def _address(name: str, port: int, bootstrap: str, feedback_url: str | None) -> str:
    if name == "broker":
        return f"kafka {bootstrap}"
    if name == "inference":
        return f"{_url(port)}/v1 (engine API)"
    if name == "gateway":
        return f"{_url(port)}/v1 (OpenAI), {_url(port)} (Anthropic)"
    if name == "reward" and feedback_url is not None:
        return f"{feedback_url}/v1/feedback (feedback API), {_url(port)}/metrics"
    return f"{_url(port)}/metrics"
