"""The services: the one table of what the stack runs, read by everything that lists them.

One row per service, named as its `harnessrl` subcommand (and as its Docker Compose service
and Kubernetes workload): where its command line and its settings are (module paths,
imported only when needed, so `harnessrl --help` loads none of them), its settings section,
its place in `harnessrl up`'s start order, whether a stack may run without it, and whether
`harnessrl chaos` may kill it. The CLI, `config show`, `up`, `chaos`, `trace` and the doctor
read it; the deployment tests check docker-compose.yml and deploy/k8s against it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ServiceSpec:
    name: str
    """Its subcommand (`harnessrl gateway`), Compose service and Kubernetes workload name."""
    cli: str
    """Module whose `register(commands)` adds its subcommand."""
    config: str
    """"module:Class" of its settings."""
    section: str
    """Its settings section (`config.sample_builder`); HARNESSRL_<SECTION>__* in the
    environment."""
    up_order: int | None
    """Its place in `harnessrl up`'s start order; None: `up` does not start it."""
    optional: bool = False
    """A stack may run without it (`up --without`): episodes are still run, captured and
    rewarded."""
    killable: bool = False
    """`harnessrl chaos` may kill it (it loses nothing: its state is on the broker or in its
    checkpoints)."""

    def config_class(self) -> type[Any]:
        """Its settings class (imported now)."""
        module, _, name = self.config.partition(":")
        cls: type[Any] = getattr(importlib.import_module(module), name)
        return cls

    @property
    def env_section(self) -> str:
        return self.section.upper()

    @property
    def tracer_name(self) -> str:
        """The OpenTelemetry service name of its spans."""
        return f"harnessrl-{self.name}"


_S = "harnessrl.services"
SERVICES: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        "broker", "harnessrl.apps.cli.broker", "harnessrl.broker:BrokerConfig", "broker", 0
    ),
    ServiceSpec(
        "inference",
        f"{_S}.inference.cli",
        f"{_S}.inference.config:InferenceConfig",
        "inference",
        1,
        killable=True,
    ),
    ServiceSpec(
        "gateway",
        f"{_S}.gateway.cli",
        f"{_S}.gateway.config:GatewayConfig",
        "gateway",
        2,
        killable=True,
    ),
    ServiceSpec(
        "reward", f"{_S}.reward.cli", f"{_S}.reward.config:RewardConfig", "reward", 3, killable=True
    ),
    ServiceSpec(
        "sample-builder",
        f"{_S}.sample_builder.cli",
        f"{_S}.sample_builder.config:SampleBuilderConfig",
        "sample_builder",
        4,
        optional=True,
        killable=True,
    ),
    ServiceSpec(
        "trainer",
        f"{_S}.trainer.cli",
        f"{_S}.trainer.config:TrainerConfig",
        "trainer",
        5,
        optional=True,
        killable=True,
    ),
    ServiceSpec(
        "controller",
        f"{_S}.controller.cli",
        f"{_S}.controller.config:ControllerConfig",
        "controller",
        6,
        killable=True,
    ),
    ServiceSpec(
        "vllm-sync",
        f"{_S}.inference.cli",
        f"{_S}.inference.config:VllmSyncConfig",
        "vllm_sync",
        None,
    ),
)
BY_NAME = {spec.name: spec for spec in SERVICES}


def started_by_up() -> list[ServiceSpec]:
    """The services `harnessrl up` starts, in their start order."""
    return sorted((s for s in SERVICES if s.up_order is not None), key=lambda s: s.up_order or 0)


def optional() -> frozenset[str]:
    return frozenset(s.name for s in SERVICES if s.optional)


def killable() -> tuple[str, ...]:
    return tuple(s.name for s in started_by_up() if s.killable)


def command_modules() -> list[str]:
    """The modules that register the services' subcommands, once each, in table order."""
    return list(dict.fromkeys(s.cli for s in SERVICES))
