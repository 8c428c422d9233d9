"""Settings: defaults, YAML file, environment, precedence, validation, masking."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from harnessrl.broker import BrokerConfig
from harnessrl.config import ServiceConfig, load_config, masked


def test_environment_overrides_the_file_which_overrides_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "harnessrl.yaml"
    path.write_text(
        "kafka:\n  bootstrap_servers: file-host:9092\n  partitions: 12\n"
        "broker:\n  listen_port: 19092\n"
        "gateway:\n  anything: ignored by the broker\n"
    )
    monkeypatch.setenv("HARNESSRL_KAFKA__PARTITIONS", "4")
    config = load_config(BrokerConfig, path)
    assert config.kafka.bootstrap_servers == "file-host:9092"
    assert config.kafka.partitions == 4
    assert config.broker.listen_port == 19092
    assert config.kafka.linger_ms == 2  # default


def test_explicit_overrides_win_and_merge_into_sections(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HARNESSRL_KAFKA__PARTITIONS", "4")
    config = load_config(ServiceConfig, kafka={"bootstrap_servers": "cli:1"})
    assert config.kafka.bootstrap_servers == "cli:1"
    assert config.kafka.partitions == 4


def test_config_file_from_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("log:\n  format: text\n")
    monkeypatch.setenv("HARNESSRL_CONFIG", str(path))
    assert load_config(ServiceConfig).log.format == "text"


def test_bad_values_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESSRL_KAFKA__BOOTSTRAP_SERVERS", "no-port")
    with pytest.raises(ValidationError, match="bootstrap_servers") as info:
        load_config(ServiceConfig)
    assert "is not host:port" in str(info.value)


def test_unknown_keys_in_a_known_section_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("kafka:\n  bootstrap_server: typo:9092\n")
    with pytest.raises(ValidationError, match="bootstrap_server"):
        load_config(ServiceConfig, path)


def test_missing_config_file_is_reported() -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(ServiceConfig, "/nonexistent/harnessrl.yaml")


def test_settings_are_frozen() -> None:
    config = load_config(ServiceConfig)
    with pytest.raises(ValidationError):
        config.kafka.partitions = 3  # type: ignore[misc]


def test_secrets_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESSRL_KAFKA__SASL_PASSWORD", "hunter2")
    config = load_config(ServiceConfig)
    assert config.kafka.sasl_password is not None
    assert config.kafka.sasl_password.get_secret_value() == "hunter2"
    shown = masked(config)
    assert shown["kafka"]["sasl_password"] == "**********"
    assert "hunter2" not in str(shown)


def test_every_field_has_a_description() -> None:
    from harnessrl.apps.cli.config_cmd import _descriptions

    described = {path for path, _ in _descriptions(BrokerConfig)}
    assert "kafka.bootstrap_servers" in described
    assert "broker.listen_port" in described
    assert "producer.spill_dir" in described


def test_a_harness_may_not_inherit_the_services_settings() -> None:
    from harnessrl.services.controller.config import ControllerSection

    with pytest.raises(ValidationError, match="HARNESSRL_CONTROLLER__TOKEN_SECRET: HARNESSRL_"):
        ControllerSection(inherit_env=["PATH", "HARNESSRL_CONTROLLER__TOKEN_SECRET"])
    assert ControllerSection(inherit_env=["PATH"]).inherit_env == ["PATH"]


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ("gateway", "token_secret"),
        ("gateway", "admin_token"),
        ("gateway", "previous_token_secrets"),
        ("controller", "token_secret"),
        ("controller", "admin_token"),
    ],
)
def test_short_shared_secrets_are_refused_naming_the_field(section: str, field: str) -> None:
    from harnessrl.config import MIN_SECRET_CHARS
    from harnessrl.services.controller.config import ControllerConfig
    from harnessrl.services.gateway.config import GatewayConfig

    cls = GatewayConfig if section == "gateway" else ControllerConfig
    short, enough = "s" * (MIN_SECRET_CHARS - 1), "s" * MIN_SECRET_CHARS
    value = [short] if field == "previous_token_secrets" else short
    with pytest.raises(
        ValueError, match=rf"{section}\.{field}\n.*31 characters; at least 32"
    ) as err:
        load_config(cls, **{section: {field: value}})
    assert short not in str(err.value)  # a refused secret is not echoed
    ok = [enough] if field == "previous_token_secrets" else enough
    load_config(cls, **{section: {field: ok}})
