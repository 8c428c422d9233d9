"""docker-compose.yml: valid Compose (checked offline by the `compose-spec` package, dev extra),
and what it runs is what harnessrl accepts: real subcommands and flags, settings that exist
and load, health checks on the ports the services listen on, and addresses that match."""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import re
import tempfile
import tomllib
from pathlib import Path
from typing import Any, get_args
from urllib.parse import urlsplit

import pytest
import yaml
from compose_spec import PyCompose
from pydantic import BaseModel

from harnessrl import registry
from harnessrl.apps.cli import build_parser
from harnessrl.config import ServiceConfig, load_config
from harnessrl.services.controller.config import ControllerConfig
from harnessrl.services.gateway.config import GatewayConfig
from harnessrl.services.inference.config import InferenceConfig, VllmSyncConfig
from harnessrl.services.reward.config import RewardConfig
from harnessrl.services.trainer.config import TrainerConfig

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
IMAGE = "harnessrl:latest"
DOCKERFILE = "deploy/Dockerfile"
PREFIX = "HARNESSRL_"
# What a user puts in .env: the only variables the file requires.
SECRETS = {
    "HARNESSRL_TOKEN_SECRET": "token-secret-x-0123456789abcdef0123",
    "HARNESSRL_ADMIN_TOKEN": "admin-token-x-0123456789abcdef01234",
}

# Compose service -> (its config class, its section): every harnessrl service of the stack,
# named as its `harnessrl` subcommand, as the service registry has them (the broker is
# Kafka's here), and the second gateway replica.
SERVICES: dict[str, tuple[type[ServiceConfig], str]] = {
    spec.name: (spec.config_class(), spec.section)
    for spec in registry.SERVICES
    if spec.name != "broker"
}
SERVICES["gateway-1"] = SERVICES["gateway"]
PROFILED = {"vllm-sync": ["gpu"], "gateway-1": ["two-gateways"]}
REPLICA_OF = {"gateway-1": "gateway"}
"""Services that are another replica of a harnessrl service (the command they run)."""
"""harnessrl services that start only with a profile."""
LONG_RUNNING = {"kafka", "jaeger", *SERVICES, "vllm", "custom-reward"}
HEALTHZ = re.compile(r"urlopen\('http://127\.0\.0\.1:(\d+)/healthz'")

# Compose interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
# ${VAR?error}, ${VAR:+other}, ${VAR+other}.
_INTERPOLATION = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_]\w*))"
)


class MissingVariable(ValueError):
    """A ${VAR:?error} whose variable is not set."""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """`value` with every string interpolated as `docker compose` does from `env`."""

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["bare"]
        current = env.get(name)
        op, arg = match["op"], match["arg"]
        if op is None:
            return current or ""
        unset = current is None or (op.startswith(":") and current == "")
        if op.endswith("-"):
            return arg if unset else str(current)
        if op.endswith("?"):
            if unset:
                raise MissingVariable(f"{name}: {arg}")
            return str(current)
        return "" if unset else arg

    if isinstance(value, str):
        return _INTERPOLATION.sub(substitute, value)
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    return value


def raw() -> Obj:
    data = yaml.safe_load(COMPOSE_FILE.read_text())  # also resolves the `<<:` merge keys
    assert isinstance(data, dict)
    return data


def compose(**env: str) -> Obj:
    """The file as Compose sees it with .env holding SECRETS (plus `env`)."""
    return dict(interpolate(raw(), {**SECRETS, **env}))


def validate(data: Obj) -> None:
    """Validate against the Compose Specification (compose-spec: Rust compose_spec parser)."""
    PyCompose.from_json(json.dumps(data)).to_spec()


def environment(service: Obj) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def mounts(service: Obj) -> dict[str, tuple[str, bool]]:
    """target -> (source, read only) of the service's volumes (short syntax)."""
    found = {}
    for entry in service.get("volumes", []):
        assert isinstance(entry, str), f"use the short volume syntax: {entry}"
        source, target, *mode = entry.split(":")
        found[target] = (source, "ro" in (mode[0].split(",") if mode else []))
    return found


def healthz_port(name: str, service: Obj) -> int:
    test = service.get("healthcheck", {}).get("test")
    assert test and test[0] == "CMD", f"{name}: no exec-form healthcheck"
    match = HEALTHZ.search(" ".join(test))
    assert match, f"{name}: the healthcheck does not GET http://127.0.0.1:PORT/healthz"
    return int(match.group(1))


def secret_files(data: Obj, service: Obj) -> dict[str, str]:
    """The service's Compose secrets as files with the values .env holds (SECRETS): path in
    the container -> path here."""
    directory = Path(tempfile.mkdtemp(prefix="compose-secrets-"))
    files = {}
    for name in service.get("secrets", []):
        source = data["secrets"][name]["environment"]
        (directory / name).write_text(SECRETS[source] + "\n")
        files[f"/run/secrets/{name}"] = str(directory / name)
    return files


def load_service(
    data: Obj, name: str, monkeypatch: pytest.MonkeyPatch, **extra_env: str
) -> ServiceConfig:
    """Load the service's config from its container environment alone (no file, nothing
    of this process's HARNESSRL_* variables), its Compose secrets mounted as files."""
    cls, _ = SERVICES[name]
    files = secret_files(data, data["services"][name])
    env = {
        key: files.get(value, value)
        for key, value in {**environment(data["services"][name]), **extra_env}.items()
    }
    with monkeypatch.context() as patch:
        for key in list(os.environ):
            if key.startswith(PREFIX):
                patch.delenv(key)
        for key, value in env.items():
            patch.setenv(key, value)
        return load_config(cls)


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("harnessrl's parser has no subcommands")


def models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models a field's annotation allows (X, X | None, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in models_in(arg)]


def check_setting(cls: type[ServiceConfig], own_section: str, key: str) -> None:
    """HARNESSRL_<SECTION>__<FIELD>[__<FIELD>...] names a real field of `cls` in a shared
    section or the service's own (the loader ignores unknown sections silently)."""
    path = key.removeprefix(PREFIX).lower().split("__")
    model: type[BaseModel] = cls
    shared = {"instance", "kafka", "producer", "consumer", "telemetry", "log"}
    shared |= {"production"} & set(cls.model_fields)  # the services of production sessions
    assert path[0] in shared | {own_section}, f"{key}: not a section {own_section} reads"
    for i, part in enumerate(path):
        field = model.model_fields.get(part)
        assert field is not None, f"{key}: {model.__name__} has no field {part!r}"
        if i < len(path) - 1:
            nested = models_in(field.annotation)
            assert nested, f"{key}: {part!r} has no fields"
            model = nested[0]


# -- the file --------------------------------------------------------------------------------


def test_file_is_valid_compose_specification() -> None:
    data = raw()
    assert "version" not in data, "the Compose Specification has no top-level version"
    validate(compose())
    for variant in (
        compose(HARNESSRL_ENGINES='["http://vllm:8100"]'),
        compose(HARNESSRL_REWARD_SOURCE="grpc:custom-reward:50061"),
    ):
        validate(variant)


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["services"]["gateway"].update(imagee="x"),  # unknown service key
        lambda d: d["services"]["gateway"]["depends_on"]["kafka"].update(condition="up"),
        lambda d: d["services"]["trainer"].update(restart="sometimes"),
        lambda d: d["services"]["kafka"]["healthcheck"].update(interval="soon"),
        lambda d: d.update(servicez={}),  # unknown top-level key
    ],
    ids=["unknown-key", "depends-on-condition", "restart", "duration", "top-level"],
)
def test_validator_rejects_invalid_compose(break_it: Any) -> None:
    data = copy.deepcopy(compose())
    validate(data)
    break_it(data)
    with pytest.raises(ValueError):
        validate(data)


def test_the_two_secrets_are_compose_secrets_never_environment_values() -> None:
    """Both come from .env as Compose secrets: files under /run/secrets in the services
    that list them; no service's environment holds either value."""
    data = compose()
    assert {n: d["environment"] for n, d in data["secrets"].items()} == {
        "token_secret": "HARNESSRL_TOKEN_SECRET",
        "admin_token": "HARNESSRL_ADMIN_TOKEN",
    }
    for name, service in data["services"].items():
        values = " ".join(environment(service).values())
        assert not any(secret in values for secret in SECRETS.values()), name
    for name in ("gateway", "gateway-1", "controller"):
        service = data["services"][name]
        assert service["secrets"] == ["token_secret", "admin_token"], name
        section = SERVICES[name][1].upper()
        env = environment(service)
        assert env[f"{PREFIX}{section}__TOKEN_SECRET_FILE"] == "/run/secrets/token_secret"
        assert env[f"{PREFIX}{section}__ADMIN_TOKEN_FILE"] == "/run/secrets/admin_token"
    compose()  # with both, nothing else is required


def test_dependencies_exist_and_start_in_order() -> None:
    services = compose()["services"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for other, how in depends.items():
            assert other in services, f"{name} depends on unknown service {other}"
            assert name not in services[other].get("depends_on", {}), f"{name} <-> {other}"
            # A service of the default profile may not wait for an optional one.
            if not service.get("profiles"):
                assert not services[other].get("profiles"), f"{name} needs profile of {other}"
            assert how["condition"] in (
                "service_healthy",
                "service_started",
                "service_completed_successfully",
            )
            if other != "jaeger":
                assert how["condition"] != "service_started", f"{name} -> {other}: not ready"
    for name in SERVICES:
        assert services[name]["depends_on"]["kafka"] == {"condition": "service_healthy"}, name
        assert "healthcheck" in services["kafka"]
    assert services["gateway"]["depends_on"]["inference"]["condition"] == "service_healthy"
    assert services["controller"]["depends_on"]["gateway"]["condition"] == "service_healthy"


def test_profiles_and_restart_policy() -> None:
    services = compose()["services"]
    assert services["vllm"]["profiles"] == ["gpu"]
    assert services["custom-reward"]["profiles"] == ["custom-reward"]
    for name, profiles in PROFILED.items():
        assert services[name]["profiles"] == profiles, name
    for name in (*SERVICES.keys() - PROFILED.keys(), "kafka", "jaeger"):
        assert not services[name].get("profiles"), f"{name} must start by default"
    for name in LONG_RUNNING:
        assert services[name].get("restart") == "unless-stopped", name


def test_volumes_are_declared_and_bind_mounts_exist() -> None:
    data = compose()
    declared = set(data.get("volumes", {}))
    used = set()
    for name, service in data["services"].items():
        for target, (source, _) in mounts(service).items():
            if source.startswith((".", "/")):
                assert (ROOT / source).exists(), f"{name}: {source} (for {target}) is missing"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared, f"declared but unused: {declared - used}"
    assert (ROOT / "examples/tiny-model/calculator/config.json").is_file()


# -- the harnessrl services ------------------------------------------------------------------


def test_every_harnessrl_service_runs_a_real_subcommand_with_real_flags() -> None:
    services = compose()["services"]
    commands = subcommands()
    for name in SERVICES:
        command = services[name]["command"]
        assert isinstance(command, list), f"{name}: use the exec form of command"
        runs = REPLICA_OF.get(name, name)
        assert command[0] == runs, f"service {name} runs `harnessrl {command[0]}`"
        assert command[0] in commands, f"{name}: harnessrl has no subcommand {command[0]}"
        assert "entrypoint" not in services[name], f"{name}: the image's entrypoint is harnessrl"
        try:
            args = build_parser().parse_args(command)
        except SystemExit as err:
            pytest.fail(f"{name}: harnessrl rejects {command} (exit {err.code})")
        assert callable(getattr(args, "run", None)), name


def test_services_share_one_image_built_from_the_dockerfile() -> None:
    services = compose()["services"]
    for name in (*SERVICES.keys(), "volumes-init"):
        assert services[name]["image"] == IMAGE, name
        assert services[name]["build"] == {"context": ".", "dockerfile": DOCKERFILE}, name
    assert (ROOT / DOCKERFILE).is_file()
    # The controller runs the calculator harness, which needs the openai SDK: the image has
    # it because the wheel declares it (the chaos and load commands use it).
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(line.startswith("openai") for line in project["dependencies"])


def test_every_setting_in_the_environment_exists() -> None:
    services = compose()["services"]
    for name, (cls, section) in SERVICES.items():
        for key in environment(services[name]):
            if key.startswith(PREFIX):
                check_setting(cls, section, key)


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_service_loads_its_config_and_is_probed_where_it_listens(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = compose()
    service = data["services"][name]
    env = environment(service)
    config = load_service(data, name, monkeypatch)
    section = getattr(config, SERVICES[name][1])
    assert section.host == "0.0.0.0", f"{name} listens on {section.host} only"
    port_key = f"{PREFIX}{SERVICES[name][1].upper()}__PORT"
    assert int(env[port_key]) == section.port
    assert healthz_port(name, service) == section.port, f"{name}: probed on another port"
    assert config.kafka.bootstrap_servers == "kafka:9092"
    assert config.telemetry.exporter == "otlp-grpc"
    assert config.telemetry.endpoint == "http://jaeger:4317"
    assert "jaeger" in data["services"]
    # The spill log is on the named volume, under a name that survives re-creation.
    assert mounts(service)[str(config.producer.spill_dir)][0] == "spill"
    assert config.instance == env[f"{PREFIX}INSTANCE"]


def test_the_engine_serves_the_mounted_model(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose()
    config = load_service(data, "inference", monkeypatch)
    assert isinstance(config, InferenceConfig)
    source, read_only = mounts(data["services"]["inference"])[str(config.inference.model)]
    assert read_only and (ROOT / source / "config.json").is_file()
    assert config.inference.advertise_url == f"http://inference:{config.inference.port}"
    args = build_parser().parse_args(data["services"]["inference"]["command"])
    assert args.device == "cpu"
    assert not args.no_follow_policy, "the engine must load new policy versions"


def test_gateway_and_controller_reach_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose()
    gateway = load_service(data, "gateway", monkeypatch)
    controller = load_service(data, "controller", monkeypatch)
    engine = load_service(data, "inference", monkeypatch)
    assert isinstance(gateway, GatewayConfig)
    assert isinstance(controller, ControllerConfig)
    assert isinstance(engine, InferenceConfig)
    assert gateway.gateway.engines == [f"http://inference:{engine.inference.port}"]
    for section in (gateway.gateway, controller.controller):
        assert section.token_secret is not None and section.admin_token is not None
        assert section.token_secret.get_secret_value() == SECRETS["HARNESSRL_TOKEN_SECRET"]
        assert section.admin_token.get_secret_value() == SECRETS["HARNESSRL_ADMIN_TOKEN"]
    assert [r.name for r in controller.controller.replicas] == ["gateway-0"]
    check_replicas(data, controller, monkeypatch)


def check_replicas(data: Obj, controller: ServiceConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each replica the controller lists is a gateway service of that replica name, at the
    port it listens on."""
    assert isinstance(controller, ControllerConfig)
    for replica in controller.controller.replicas:
        url = urlsplit(replica.url)
        assert url.hostname in data["services"], replica
        gateway = load_service(data, str(url.hostname), monkeypatch)
        assert isinstance(gateway, GatewayConfig)
        assert gateway.gateway.replica == replica.name
        assert url.port == gateway.gateway.port


def test_the_two_gateways_override_lists_both_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose()
    override = yaml.safe_load((ROOT / "deploy" / "compose" / "two-gateways.yml").read_text())
    for name, service in override["services"].items():  # what `-f A -f B` merges
        merged = data["services"][name]
        merged["environment"] = {**environment(merged), **service.get("environment", {})}
        merged["depends_on"] = {**merged.get("depends_on", {}), **service.get("depends_on", {})}
    validate(data)
    controller = load_service(data, "controller", monkeypatch)
    assert isinstance(controller, ControllerConfig)
    assert [r.name for r in controller.controller.replicas] == ["gateway-0", "gateway-1"]
    check_replicas(data, controller, monkeypatch)


def test_controller_runs_the_calculator_harness_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose()
    service = data["services"]["controller"]
    config = load_service(data, "controller", monkeypatch)
    assert isinstance(config, ControllerConfig)
    section = config.controller
    args = build_parser().parse_args(service["command"])
    assert (args.runner or section.runner) == "local"
    assert section.harness is not None
    program, script = section.harness.command
    assert program == "python"
    source, read_only = mounts(service)["/app/examples"]
    assert read_only and source == "./examples"
    assert (ROOT / "examples" / Path(script).relative_to("/app/examples")).is_file()
    assert section.harness.preload == []  # sandboxed runs never fork from a preloaded server
    assert section.sandbox.mode == "bwrap"  # every harness contained
    # Its run records and working directories persist on a named volume.
    volumes = mounts(service)
    for path in (section.workdir, section.state_dir):
        assert any(
            path.is_relative_to(target) and source == "controller-state"
            for target, (source, _) in volumes.items()
        ), path


def test_trainer_serves_weightsync_where_the_engines_dial(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = compose()
    config = load_service(data, "trainer", monkeypatch)
    assert isinstance(config, TrainerConfig)
    trainer = config.trainer
    assert trainer.weightsync.host == "0.0.0.0"
    assert trainer.advertise_address == f"trainer:{trainer.weightsync.port}"
    volumes = mounts(data["services"]["trainer"])
    assert volumes[str(trainer.checkpoint_dir)][0] == "checkpoints"
    assert volumes[str(trainer.model)][1], "the initial policy is mounted read-only"
    assert data["services"]["volumes-init"]["entrypoint"][0] == "chown"
    owned = set(mounts(data["services"]["volumes-init"]))
    assert {str(trainer.checkpoint_dir), str(config.producer.spill_dir)} <= owned


def test_reward_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose()
    config = load_service(data, "reward", monkeypatch)
    assert isinstance(config, RewardConfig)
    kind, module, function = config.reward.source.split(":")
    assert kind == "entrypoint"
    assert callable(getattr(importlib.import_module(module), function))
    assert environment(data["services"]["reward"])["PYTHONPATH"] == "/app"
    assert "/app/examples" in mounts(data["services"]["reward"])
    # The example gRPC server, profile custom-reward: the port it binds, on a network the
    # reward service shares with it and the controller (where harnesses run) is not on.
    data = compose(HARNESSRL_REWARD_SOURCE="grpc:custom-reward:50061")
    config = load_service(data, "reward", monkeypatch)
    assert isinstance(config, RewardConfig)
    _, host, port = config.reward.source.split(":")
    server = data["services"][host]
    assert server["build"]["dockerfile"] == "examples/reward_service/Dockerfile"
    assert (ROOT / server["build"]["dockerfile"]).is_file()
    assert server["command"][server["command"].index("--port") + 1] == port
    shared = set(server["networks"]) & set(data["services"]["reward"]["networks"])
    assert shared and not shared & set(data["services"]["controller"].get("networks", [])), shared
    assert all(data["networks"][n].get("internal") for n in shared)


def test_vllm_profile_runs_the_worker_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose(HARNESSRL_ENGINES='["http://vllm:8100"]')
    vllm = data["services"]["vllm"]
    command = vllm["command"]
    path = command[command.index("--worker-extension-cls") + 1]
    module, _, attr = path.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), attr), type), path
    port = int(command[command.index("--port") + 1])
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert any("gpu" in d["capabilities"] for d in devices)
    gateway = load_service(data, "gateway", monkeypatch)
    assert isinstance(gateway, GatewayConfig)
    assert gateway.gateway.engines == [f"http://vllm:{port}"]
    assert mounts(vllm)["/models/policy"][1]
    assert command[0] == "/models/policy"
    assert environment(vllm)["VLLM_SERVER_DEV_MODE"] == "1"  # /pause, /resume, /collective_rpc


def test_vllm_sync_drives_the_vllm_the_gateway_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose(HARNESSRL_ENGINES='["http://vllm:8100"]')
    sync = load_service(data, "vllm-sync", monkeypatch)
    gateway = load_service(data, "gateway", monkeypatch)
    assert isinstance(sync, VllmSyncConfig) and isinstance(gateway, GatewayConfig)
    section = sync.vllm_sync
    assert section.vllm_url is not None
    url = urlsplit(section.vllm_url)
    vllm = data["services"][str(url.hostname)]
    assert vllm["entrypoint"] == ["vllm", "serve"]
    assert url.port == int(vllm["command"][vllm["command"].index("--port") + 1])
    # The gateway stamps vLLM's calls by the engine name of its PolicyLoaded events.
    assert (section.engine_name or section.vllm_url) in gateway.gateway.engines
    depends = data["services"]["vllm-sync"]["depends_on"]
    assert depends["vllm"] == depends["trainer"] == {"condition": "service_healthy"}


def test_kafka_is_kraft_with_room_for_large_records(monkeypatch: pytest.MonkeyPatch) -> None:
    data = compose()
    kafka = data["services"]["kafka"]
    env = environment(kafka)
    assert kafka["image"].startswith("apache/kafka:")
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{env['KAFKA_NODE_ID']}@kafka:9093"
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    trainer = load_service(data, "trainer", monkeypatch)
    for key in ("KAFKA_MESSAGE_MAX_BYTES", "KAFKA_REPLICA_FETCH_MAX_BYTES"):
        assert int(env[key]) >= trainer.kafka.max_request_bytes, key
    assert mounts(kafka)[env["KAFKA_LOG_DIRS"]][0] == "kafka-data"
    assert "kafka-broker-api-versions.sh" in " ".join(kafka["healthcheck"]["test"])
    jaeger = data["services"]["jaeger"]
    assert environment(jaeger)["COLLECTOR_OTLP_ENABLED"] == "true"
    assert any(str(p).endswith(":16686") for p in jaeger["ports"])
