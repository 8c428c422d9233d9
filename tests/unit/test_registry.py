"""The service registry (harnessrl.registry): every row names a real subcommand, a real
settings class with its section, and the orders and flags the CLI, up and chaos read."""

from __future__ import annotations

import argparse

import pytest

from harnessrl import registry
from harnessrl.apps.chaos import KILLABLE
from harnessrl.apps.cli import build_parser
from harnessrl.apps.cli.config_cmd import SERVICES as SHOWN
from harnessrl.apps.up.plan import OPTIONAL
from harnessrl.config import ServiceConfig


def _subcommands() -> set[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("no subcommands")


@pytest.mark.parametrize("spec", registry.SERVICES, ids=[s.name for s in registry.SERVICES])
def test_each_service_is_a_subcommand_with_its_settings_section(
    spec: registry.ServiceSpec,
) -> None:
    assert spec.name in _subcommands()
    cls = spec.config_class()
    assert issubclass(cls, ServiceConfig)
    assert spec.section in cls.model_fields
    assert registry.BY_NAME[spec.name] is spec


def test_up_starts_the_broker_first_and_the_controller_last() -> None:
    order = [s.name for s in registry.started_by_up()]
    assert order[0] == "broker" and order[-1] == "controller"
    assert len(order) == len(set(order)) == len({s.up_order for s in registry.started_by_up()})


def test_the_cli_config_up_and_chaos_read_the_registry() -> None:
    assert set(SHOWN) == set(registry.BY_NAME)
    assert {"trainer", "sample-builder"} == OPTIONAL
    assert KILLABLE == ("inference", "gateway", "reward", "sample-builder", "trainer", "controller")
    assert "broker" not in KILLABLE  # the embedded broker keeps its data in memory only
