"""The kustomize tree under deploy/k8s: each overlay renders (`kubectl kustomize`, offline),
and what it renders is what the services, the controller's runner, torchrun and Kubernetes
accept. No API server runs here: where a controller fills in a pod (a StatefulSet's
ordinal, a Job's completion index) the test does what the controller does."""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from harnessrl import registry
from harnessrl.apps.cli import build_parser
from harnessrl.config import PLACEHOLDER_PREFIX, ServiceConfig, load_config
from harnessrl.services.controller.config import ControllerConfig, GatewayReplica
from harnessrl.services.controller.kubernetes_job import JobTemplate
from harnessrl.services.controller.runner import LaunchSpec
from harnessrl.services.gateway.config import GatewayConfig
from harnessrl.services.trainer.config import TrainerConfig

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl is not on PATH: the overlays are rendered with `kubectl kustomize`",
)

Obj = dict[str, Any]

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = (
    "external-kafka",
    "strimzi",
    "trainer-multinode",
    "trainer-multinode-job",
    "gateway-replicas",
)
# The overlays whose trainer is a torchrun job over several pods: the kind of its workload.
MULTINODE = {"trainer-multinode": "StatefulSet", "trainer-multinode-job": "Job"}
# Whose secrets.env an overlay reads, when not its own (it is built on that overlay).
SECRETS_FROM = {
    "trainer-multinode": "external-kafka",
    "trainer-multinode-job": "external-kafka",
    "gateway-replicas": "external-kafka",
}
NAMESPACE = "harnessrl"
PART_OF = "app.kubernetes.io/part-of"
HARNESS_SELECTOR = {"app.kubernetes.io/component": "harness"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
STRIMZI_GROUP = "kafka.strimzi.io/"
WORKLOADS = ("Deployment", "StatefulSet", "Job")

# The service each `harnessrl <command>` runs: its config class and its section in it, as
# the service registry has them (the broker is Kafka's here, vllm-sync belongs to the GPU
# deployments).
SERVICES: dict[str, tuple[type[ServiceConfig], str]] = {
    spec.name: (spec.config_class(), spec.section)
    for spec in registry.SERVICES
    if spec.name not in ("broker", "vllm-sync")
}
EXPECTED_WORKLOADS = {
    ("Deployment", "controller"),
    ("Deployment", "reward"),
    ("Deployment", "sample-builder"),
    ("Deployment", "trainer"),
    ("Deployment", "inference"),
    ("StatefulSet", "gateway"),
}
PROBES = ("startupProbe", "livenessProbe", "readinessProbe")


def test_the_workloads_are_the_services_of_the_registry() -> None:
    assert {name for _, name in EXPECTED_WORKLOADS} == set(SERVICES)
    assert set(SERVICES) == {s.name for s in registry.started_by_up()} - {"broker"}


RANK_PORT = 29500  # torchrun's rendezvous store on node rank 0 (--master-port)
NCCL_PORT = 45000  # one of the ephemeral ports NCCL and gloo listen on
# The controller's whole grant: (API group, resource, verb).
ROLE_GRANTS = {
    *(("batch", "jobs", v) for v in ("create", "get", "list", "watch", "delete")),
    *(("", "pods", v) for v in ("get", "list", "watch")),
    ("", "pods/log", "get"),
}
SAMPLE = {
    "EPISODE_ID": "ep-g1-0",
    "ATTEMPT": "0",
    "GROUP_ID": "g1",
    "TASK_ID": "task-1",
    "JOB_NAME": "hrl-ep-g1-0-0",
}
SAMPLE_COMMAND = ["python", "harness.py", "--task", "it's $HOME"]
POD_FIELDS = {
    "status.podIP": "10.1.2.3",
    "metadata.name": "gateway-0",  # a pod of the gateway StatefulSet, as its peers list it
    "metadata.namespace": NAMESPACE,
    # What the StatefulSet and Job controllers set on a pod (pod_metadata), for pod 0.
    "metadata.labels['apps.kubernetes.io/pod-index']": "0",
    "metadata.annotations['batch.kubernetes.io/job-completion-index']": "0",
}


SECRETS = {"token-secret": "t0ken-" + "a" * 58, "admin-token": "adm1n-" + "b" * 58}
"""What the operator's secrets.env holds (docs/deploy.md: printf ... "$(openssl rand -hex 32)")."""


def _kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@functools.cache
def _tree() -> Path:
    """deploy/k8s copied, with each overlay's secrets.env written as docs/deploy.md says."""
    import atexit
    import tempfile

    tree = Path(tempfile.mkdtemp(prefix="hrl-k8s-")) / "k8s"
    atexit.register(shutil.rmtree, tree.parent, True)
    shutil.copytree(ROOT / "deploy" / "k8s", tree, ignore=shutil.ignore_patterns("secrets.env"))
    for overlay in {SECRETS_FROM.get(o, o) for o in OVERLAYS}:
        lines = "".join(f"{key}={value}\n" for key, value in SECRETS.items())
        (tree / "overlays" / overlay / "secrets.env").write_text(lines)
    return tree


@functools.cache
def _render(overlay: str) -> tuple[Obj, ...]:
    done = _kustomize(_tree() / "overlays" / overlay)
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc is not None)


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def objects(overlay: str) -> tuple[Obj, ...]:
    return _render(overlay)


@pytest.fixture(params=sorted(MULTINODE))
def multinode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def kinds(objects: tuple[Obj, ...], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: tuple[Obj, ...], kind: str, name: str) -> Obj:
    found = [o for o in kinds(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def config_map(objects: tuple[Obj, ...], name: str) -> Obj:
    """A ConfigMap by its name before kustomize's hash suffix (or its exact name)."""
    found = [
        o
        for o in kinds(objects, "ConfigMap")
        if re.fullmatch(rf"{re.escape(name)}(-[a-z0-9]{{10}})?", o["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one ConfigMap {name}, found {len(found)}"
    return found[0]


def workloads(objects: tuple[Obj, ...]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, pod spec) of every Deployment, StatefulSet and Job."""
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            yield obj, obj["spec"]["template"]["spec"]


def containers(pod: Obj) -> list[Obj]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def cli_commands() -> set[str]:
    """The subcommands `harnessrl` knows, from its own parser."""
    parser = build_parser()
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            names |= set(action.choices)
    assert names, "harnessrl's parser has no subcommands"
    return names


def command_of(container: Obj) -> str:
    """The harnessrl subcommand a container runs (the image's entrypoint is `harnessrl`; or
    `torchrun ... -m harnessrl.services.<command>`, the same service as ranks)."""
    words = [*container.get("command", []), *container.get("args", [])]
    if words and words[0] == "torchrun":
        module = words[words.index("-m") + 1]
        assert module.startswith("harnessrl.services."), f"torchrun runs {module}"
        assert importlib.util.find_spec(f"{module}.__main__"), f"no python -m {module}"
        return module.removeprefix("harnessrl.services.").replace("_", "-")
    if container.get("command"):
        assert words[0] == "harnessrl", f"{container['name']} runs {words[0]!r}, not harnessrl"
        words = words[1:]
    assert words, f"{container['name']} names no harnessrl command"
    return str(words[0])


def port_number(container: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    numbers = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert numbers, f"{container['name']} has no port named {port!r}"
    return int(numbers[0])


def healthz_port(objects: tuple[Obj, ...], pod: Obj, container: Obj, probe: str) -> int:
    """The port whose GET /healthz `probe` checks: an httpGet's, or that of the trainer
    pods' `python healthz.py PORT`, a script mounted from a ConfigMap (which
    test_multinode_probe_checks_healthz_on_node_rank_zero_only runs)."""
    what = f"{container['name']}: {probe}"
    spec = container.get(probe)
    assert spec, f"{what} missing"
    if "httpGet" in spec:
        assert spec["httpGet"]["path"] == "/healthz", f"{what} on {spec['httpGet']['path']}"
        return port_number(container, spec["httpGet"]["port"])
    python, script, port = spec["exec"]["command"]
    assert python == "python" and script.endswith("/healthz.py"), what
    assert "/healthz" in mounted_file(objects, pod, container, script), what
    return int(port)


def harnessrl_yaml(objects: tuple[Obj, ...]) -> str:
    return str(config_map(objects, "harnessrl-config")["data"]["harnessrl.yaml"])


def secret_value(objects: tuple[Obj, ...], name: str, key: str) -> str:
    secret = named(objects, "Secret", name)
    if key in secret.get("stringData", {}):
        return str(secret["stringData"][key])
    return base64.b64decode(secret["data"][key]).decode()


def container_env(
    objects: tuple[Obj, ...], container: Obj, fields: dict[str, str] = POD_FIELDS
) -> dict[str, str]:
    """The environment Kubernetes gives `container`: envFrom, then env with $(VAR) expanded,
    the downward API's values (fieldRef) taken from `fields`."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        found = [o for o in kinds(objects, "ConfigMap") if o["metadata"]["name"] == ref]
        assert found, f"{container['name']}: envFrom ConfigMap {ref} is not rendered"
        env.update({k: str(v) for k, v in found[0]["data"].items()})
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"]
            )
            continue
        source = entry["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[entry["name"]] = secret_value(objects, ref["name"], ref["key"])
        elif "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            assert path in fields, f"{container['name']}: {path} is not set on the pod"
            env[entry["name"]] = fields[path]
        else:
            raise AssertionError(f"{container['name']}: unexpected env source {source}")
    return env


def mounted_file(objects: tuple[Obj, ...], pod: Obj, container: Obj, path: str) -> str:
    """The text of the ConfigMap key mounted at `path` in `container`."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        directory = mount["mountPath"].rstrip("/")
        if path.startswith(directory + "/") and "subPath" not in mount:
            volume = volumes[mount["name"]]
            assert "configMap" in volume, f"{path} is on volume {mount['name']}, not a ConfigMap"
            ref = volume["configMap"]["name"]
            found = [o for o in kinds(objects, "ConfigMap") if o["metadata"]["name"] == ref]
            assert found, f"ConfigMap {ref} (mounted at {directory}) is not rendered"
            key = path[len(directory) + 1 :]
            assert key in found[0]["data"], f"{ref} has no key {key} for {path}"
            return str(found[0]["data"][key])
    raise AssertionError(f"nothing is mounted at {path} in {container['name']}")


def load_service_config(
    objects: tuple[Obj, ...],
    pod: Obj,
    container: Obj,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fields: dict[str, str] = POD_FIELDS,
) -> ServiceConfig:
    """Load the container's service config exactly as it would in the pod: the mounted
    $HARNESSRL_CONFIG plus its environment (and nothing of this test process's), the
    downward API's values taken from `fields`."""
    cls, _ = SERVICES[command_of(container)]
    env = container_env(objects, container, fields)
    config_path = env.pop("HARNESSRL_CONFIG", None)
    assert config_path, f"{container['name']}: HARNESSRL_CONFIG is not set"
    local = tmp_path / f"{container['name']}.yaml"
    local.write_text(mounted_file(objects, pod, container, config_path))
    with monkeypatch.context() as patch:
        for name in list(os.environ):
            if name.startswith("HARNESSRL_"):
                patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return load_config(cls, local)


def service_ports(objects: tuple[Obj, ...]) -> dict[str, set[int]]:
    return {
        s["metadata"]["name"]: {p["port"] for p in s["spec"]["ports"]}
        for s in kinds(objects, "Service")
    }


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def fill_placeholders(text: str) -> str:
    """The job template with sample values, substituted as text (placeholder by placeholder)."""
    text = re.sub(r"(?<!\$)\$\{COMMAND_JSON\}", lambda _: json.dumps(SAMPLE_COMMAND), text)
    for name, value in SAMPLE.items():
        text = re.sub(rf"(?<!\$)\$\{{{name}\}}", lambda _, v=value: v, text)
    return text


def placeholders(node: Any) -> set[str]:
    """The ${NAME} placeholders in a parsed document's strings ($${NAME} is a literal)."""
    if isinstance(node, dict):
        return set().union(*map(placeholders, node.values()), set())
    if isinstance(node, list):
        return set().union(*map(placeholders, node), set())
    if isinstance(node, str):
        return set(re.findall(r"(?<!\$)\$\{(\w+)\}", node))
    return set()


def job_template_text(objects: tuple[Obj, ...]) -> str:
    return str(config_map(objects, "harnessrl-job-template")["data"]["job.yaml"])


def rendered_job(objects: tuple[Obj, ...]) -> Obj:
    """The Job the controller's runner makes from the template for one sample attempt."""
    template = JobTemplate.parse(job_template_text(objects), NAMESPACE, source="job.yaml")
    spec = LaunchSpec(
        episode_id=SAMPLE["EPISODE_ID"],
        attempt=int(SAMPLE["ATTEMPT"]),
        group_id=SAMPLE["GROUP_ID"],
        task_id=SAMPLE["TASK_ID"],
        command=tuple(SAMPLE_COMMAND),
        env={
            "OPENAI_BASE_URL": "http://gateway-0.gateway-headless:8000/e/tok/v1",
            "OPENAI_API_KEY": "tok",
        },
        timeout_s=600.0,
    )
    return template.render(spec, namespace=NAMESPACE, ttl_seconds=600)


# -- rendering, labels, namespace ---------------------------------------------------------


def test_overlay_renders_every_service(overlay: str, objects: tuple[Obj, ...]) -> None:
    expected = EXPECTED_WORKLOADS
    if overlay in MULTINODE:  # the trainer's Deployment replaced by N torchrun pods
        expected = expected - {("Deployment", "trainer")} | {(MULTINODE[overlay], "trainer")}
    assert {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"] in WORKLOADS} == (
        expected
    )
    named(objects, "Namespace", NAMESPACE)
    named(objects, "NetworkPolicy", "harness-egress")
    for name in ("controller", "gateway", "gateway-headless", "inference", "reward"):
        named(objects, "Service", name)
    for name in ("sample-builder", "trainer"):
        named(objects, "Service", name)
    assert named(objects, "Service", "gateway-headless")["spec"]["clusterIP"] == "None"
    gateway = named(objects, "StatefulSet", "gateway")
    assert gateway["spec"]["serviceName"] == "gateway-headless"


def test_every_object_is_part_of_harnessrl_in_its_namespace(objects: tuple[Obj, ...]) -> None:
    for obj in objects:
        meta = obj["metadata"]
        what = f"{obj['kind']} {meta['name']}"
        assert (meta.get("labels") or {}).get(PART_OF) == "harnessrl", f"{what}: no {PART_OF}"
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in meta, f"{what} is cluster-scoped"
        else:
            assert meta.get("namespace") == NAMESPACE, f"{what} is not in {NAMESPACE}"
    for workload, _ in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels.get(PART_OF) == "harnessrl", f"{workload['metadata']['name']}'s pods"


def test_secrets_come_from_the_operators_file_and_placeholders_are_refused(
    overlay: str, objects: tuple[Obj, ...], tmp_path: Path
) -> None:
    # The base holds only marked placeholders...
    base = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / "secret.yaml").read_text())
    assert set(base["stringData"]) == set(SECRETS)
    for key, value in base["stringData"].items():
        assert value.startswith(PLACEHOLDER_PREFIX), f"{key} must be a marked placeholder"
        for cls, section in ((GatewayConfig, "gateway"), (ControllerConfig, "controller")):
            field = {"token-secret": "token_secret", "admin-token": "admin_token"}[key]
            with pytest.raises(ValueError, match=f"{section}.{field}"):
                load_config(cls, **{section: {field: value}})
    # ...which each overlay replaces with secrets.env, the only place the values live...
    for key, value in SECRETS.items():
        assert secret_value(objects, "harnessrl-secrets", key) == value
    assert len(kinds(objects, "Secret")) == 1
    # ...and without that file the overlay does not render at all.
    bare = tmp_path / "k8s"
    shutil.copytree(_tree(), bare)
    (bare / "overlays" / SECRETS_FROM.get(overlay, overlay) / "secrets.env").unlink()
    done = _kustomize(bare / "overlays" / overlay)
    assert done.returncode != 0 and "secrets.env" in done.stderr
    assert "secrets.env" in (ROOT / ".gitignore").read_text()


# -- RBAC --------------------------------------------------------------------------------


def test_controller_role_grants_exactly_jobs_pods_and_logs(objects: tuple[Obj, ...]) -> None:
    assert not kinds(objects, "ClusterRole") and not kinds(objects, "ClusterRoleBinding")
    roles = kinds(objects, "Role")
    assert len(roles) == 1
    role = roles[0]
    grants = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected rule keys {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert "*" not in (group, resource, verb), f"wildcard in {rule}"
                    grants.add((group, resource, verb))
    assert grants == ROLE_GRANTS

    (binding,) = kinds(objects, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount"
    assert subject.get("namespace", NAMESPACE) == NAMESPACE
    named(objects, "ServiceAccount", subject["name"])
    # Only the controller runs as it; every other pod gets no API token at all.
    for workload, pod in workloads(objects):
        if workload["metadata"]["name"] == "controller":
            assert pod["serviceAccountName"] == subject["name"]
        else:
            assert pod.get("serviceAccountName") in (None, "default")
            assert pod.get("automountServiceAccountToken") is False


# -- NetworkPolicy -----------------------------------------------------------------------


def test_harness_pods_may_reach_only_the_gateway_port_and_dns(objects: tuple[Obj, ...]) -> None:
    policies = [
        p
        for p in kinds(objects, "NetworkPolicy")
        if p["spec"]["podSelector"].get("matchLabels") == HARNESS_SELECTOR
    ]
    assert len(policies) == 1
    spec = policies[0]["spec"]
    assert set(spec["podSelector"]) == {"matchLabels"}
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    assert not spec.get("ingress"), "harness pods accept no connections"

    gateway = named(objects, "StatefulSet", "gateway")
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]
    gateway_container = gateway["spec"]["template"]["spec"]["containers"][0]
    gateway_port = port_number(gateway_container, "http")
    assert port_number(gateway_container, "admin") != gateway_port  # not opened below
    allowed: set[tuple[str, str, int]] = set()
    for rule in spec["egress"]:
        assert rule.get("to") and rule.get("ports"), f"egress rule open to all: {rule}"
        for peer in rule["to"]:
            assert "ipBlock" not in peer, f"egress to addresses: {peer}"
            pods = peer["podSelector"]["matchLabels"]
            if "namespaceSelector" in peer:
                assert peer["namespaceSelector"]["matchLabels"] == {
                    "kubernetes.io/metadata.name": "kube-system"
                }
                assert pods == {"k8s-app": "kube-dns"}
                target = "dns"
            else:
                assert selects(pods, gateway_labels), f"{pods} does not select the gateway"
                others = [
                    w["metadata"]["name"]
                    for w, _ in workloads(objects)
                    if w is not gateway
                    and selects(pods, w["spec"]["template"]["metadata"]["labels"])
                ]
                assert not others, f"{pods} also selects {others}"
                target = "gateway"
            for port in rule["ports"]:
                allowed.add((target, port.get("protocol", "TCP"), port["port"]))
    assert allowed == {
        ("gateway", "TCP", gateway_port),
        ("dns", "UDP", 53),
        ("dns", "TCP", 53),
    }

    # The policy covers the harness pods the template makes, and no service's pods.
    job = rendered_job(objects)
    assert selects(HARNESS_SELECTOR, job["spec"]["template"]["metadata"]["labels"])
    for workload, _ in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert not selects(HARNESS_SELECTOR, labels), workload["metadata"]["name"]


# -- containers --------------------------------------------------------------------------


def test_every_container_runs_a_harnessrl_command_with_healthz_probes(
    objects: tuple[Obj, ...],
) -> None:
    commands = cli_commands()
    for workload, pod in workloads(objects):
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"].get("runAsUser", 1) != 0
        for container in containers(pod):
            what = f"{workload['metadata']['name']}/{container['name']}"
            assert command_of(container) in commands, f"{what}: not a harnessrl command"
            for probe in ("livenessProbe", "readinessProbe"):
                healthz_port(objects, pod, container, probe)
            assert container["resources"]["requests"].get("cpu"), what
            assert container["resources"]["requests"].get("memory"), what
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, what
            assert context["capabilities"]["drop"] == ["ALL"], what


def test_each_service_loads_its_config_and_listens_where_probes_and_services_look(
    objects: tuple[Obj, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = service_ports(objects)
    seen = set()
    for workload, pod in workloads(objects):
        for container in pod["containers"]:
            command = command_of(container)
            seen.add(command)
            config = load_service_config(objects, pod, container, tmp_path, monkeypatch)
            section = getattr(config, SERVICES[command][1])
            what = f"{workload['metadata']['name']}/{container['name']}"
            assert section.host == "0.0.0.0", f"{what} listens on {section.host} only"
            probe_port = healthz_port(objects, pod, container, "livenessProbe")
            assert probe_port == section.port, f"{what}: probes {probe_port}, serves {section.port}"
            assert section.port in services[workload["metadata"]["name"]], what
            assert config.telemetry.exporter == "otlp-grpc"
            assert config.telemetry.endpoint and config.telemetry.endpoint.startswith("http")
            if command in ("gateway", "controller"):
                assert section.token_secret is not None and section.admin_token is not None
                assert section.token_secret.get_secret_value() == secret_value(
                    objects, "harnessrl-secrets", "token-secret"
                ), what
            if command == "controller":
                check_controller(objects, pod, container, config, services)
            if command == "gateway":
                for url in section.engines:
                    check_url(url, services, "inference")
                assert section.admin_port is not None, "the admin API shares the harness port"
                assert section.admin_port == port_number(container, "admin")
                assert section.admin_port in services["gateway"]
            if command == "trainer":
                host, _, port = section.advertise_address.rpartition(":")
                assert section.weightsync.host == "0.0.0.0"
                assert int(port) == section.weightsync.port
                assert int(port) in services[host], f"no Service {host}:{port} (WeightSync)"
                assert int(port) in {p["containerPort"] for p in container["ports"]}
            if command == "inference":
                assert section.advertise_url == f"http://{POD_FIELDS['status.podIP']}:8100"
    assert seen == set(SERVICES)


def check_url(url: str, services: dict[str, set[int]], service: str) -> None:
    parts = urlsplit(url)
    assert parts.hostname == service, f"{url} is not the {service} Service"
    assert parts.port in services[service], f"{url}: the {service} Service has no such port"


def check_controller(
    objects: tuple[Obj, ...],
    pod: Obj,
    container: Obj,
    config: ServiceConfig,
    services: dict[str, set[int]],
) -> None:
    assert isinstance(config, ControllerConfig)
    section = config.controller
    assert section.runner == "kubernetes"
    assert section.harness is not None
    check_gateway_replicas(objects, section.replicas)
    kube = section.kubernetes
    assert kube is not None
    assert kube.namespace == NAMESPACE
    assert kube.kubeconfig is None  # in-cluster: the pod's ServiceAccount
    assert kube.delete_after_collect, "the Role grants no patch (labelling collected Jobs)"
    text = mounted_file(objects, pod, container, str(kube.job_template))
    assert text == job_template_text(objects)


def gateway_pods(objects: tuple[Obj, ...]) -> tuple[Obj, Obj, list[str]]:
    """(StatefulSet, gateway container, its pods' names gateway-0 ... gateway-<N-1>)."""
    gateway = named(objects, "StatefulSet", "gateway")
    (container,) = gateway["spec"]["template"]["spec"]["containers"]
    replicas = int(gateway["spec"].get("replicas", 1))
    assert replicas >= 1
    return gateway, container, [pod_metadata(gateway, i)[0] for i in range(replicas)]


def check_gateway_replicas(objects: tuple[Obj, ...], replicas: list[GatewayReplica]) -> None:
    """The controller's gateways are the StatefulSet's pods, each at its per-pod DNS name
    under the headless Service: harness APIs on the http port, the admin API on the admin
    port."""
    gateway, container, pods = gateway_pods(objects)
    assert [r.name for r in replicas] == pods, (
        f"controller.gateways {[r.name for r in replicas]} are not the gateway pods {pods}"
    )
    headless = gateway["spec"]["serviceName"]
    ports = service_ports(objects)[headless]
    selector = named(objects, "Service", headless)["spec"]["selector"]
    for index, replica in enumerate(replicas):
        assert selects(selector, pod_metadata(gateway, index)[1]), f"{replica.name}: no DNS name"
        assert replica.admin_url is not None, f"{replica.name}: admin API on the harness port"
        for url, port in ((replica.url, "http"), (replica.admin_url, "admin")):
            parts = urlsplit(url)
            assert parts.scheme == "http", url
            assert parts.hostname == f"{replica.name}.{headless}", f"{url}: not the pod's name"
            assert parts.port in ports, f"{url}: {headless} has no such port"
            assert parts.port == port_number(container, port), f"{url}: not the {port} port"
        assert urlsplit(replica.admin_url).port != urlsplit(replica.url).port


def test_each_gateway_pod_is_the_replica_of_its_name(
    objects: tuple[Obj, ...], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gateway, container, pods = gateway_pods(objects)
    (env,) = [e for e in container["env"] if e["name"] == "HARNESSRL_GATEWAY__REPLICA"]
    assert env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    pod = gateway["spec"]["template"]["spec"]
    for index, name in enumerate(pods):
        config = load_service_config(
            objects, pod, container, tmp_path, monkeypatch, pod_fields(gateway, index)
        )
        assert isinstance(config, GatewayConfig)
        assert config.gateway.replica == name


def test_harness_pods_reach_every_gateway_replica_but_not_its_admin_port(
    objects: tuple[Obj, ...],
) -> None:
    gateway, container, pods = gateway_pods(objects)
    harness = rendered_job(objects)["spec"]["template"]["metadata"]["labels"]
    controller = named_labels(objects, "controller")
    for index in range(len(pods)):
        labels = pod_metadata(gateway, index)[1]
        assert connects(objects, harness, labels, port_number(container, "http"))
        assert not connects(objects, harness, labels, port_number(container, "admin"))
        assert connects(objects, controller, labels, port_number(container, "admin"))


def test_gateway_replicas_overlay_runs_three_and_the_controller_knows_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = _render("gateway-replicas")
    gateway = named(objects, "StatefulSet", "gateway")
    assert gateway["spec"]["replicas"] == 3
    controller = named(objects, "Deployment", "controller")
    pod = controller["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    config = load_service_config(objects, pod, container, tmp_path, monkeypatch)
    assert isinstance(config, ControllerConfig)
    # The overlay's HARNESSRL_CONTROLLER__GATEWAYS wins over the config file's one gateway.
    assert [r.name for r in config.controller.replicas] == ["gateway-0", "gateway-1", "gateway-2"]
    check_gateway_replicas(objects, config.controller.replicas)
    # The replicas share production sessions: each knows the others (the same names).
    gateway_pod = gateway["spec"]["template"]["spec"]
    (gateway_container,) = gateway_pod["containers"]
    served = load_service_config(objects, gateway_pod, gateway_container, tmp_path, monkeypatch)
    assert isinstance(served, GatewayConfig)
    assert [p.name for p in served.gateway.peers] == [r.name for r in config.controller.replicas]
    # The base keeps one (and its config file lists that one: check_controller).
    assert named(_render("external-kafka"), "StatefulSet", "gateway")["spec"]["replicas"] == 1


# -- the harness Job template ------------------------------------------------------------


def test_the_shipped_job_template_contains_harness_pods(objects: tuple[Obj, ...]) -> None:
    """The controller would refuse to start on a template whose pods are not contained."""
    template = JobTemplate.parse(job_template_text(objects), NAMESPACE, source="job.yaml")
    assert template.uncontained() == []


def test_job_template_with_sample_values_is_a_batch_v1_job(objects: tuple[Obj, ...]) -> None:
    text = job_template_text(objects)
    assert placeholders(yaml.safe_load(text)) == {*SAMPLE, "COMMAND_JSON"}
    (job,) = [d for d in yaml.safe_load_all(fill_placeholders(text)) if d is not None]
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    assert job["metadata"]["name"] == SAMPLE["JOB_NAME"]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] in ("Never", "OnFailure")
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    harness = pod["containers"][0]
    assert harness["command"] == SAMPLE_COMMAND
    assert {e["name"]: e["value"] for e in harness["env"]}["HARNESSRL_EPISODE_ID"] == (
        SAMPLE["EPISODE_ID"]
    )
    assert job["metadata"]["labels"][PART_OF] == "harnessrl"
    assert selects(HARNESS_SELECTOR, job["spec"]["template"]["metadata"]["labels"])

    # The controller's own runner accepts the template and fills it in the same way.
    made = rendered_job(objects)
    assert made["metadata"]["name"] == SAMPLE["JOB_NAME"]
    assert made["metadata"]["namespace"] == NAMESPACE
    assert made["spec"]["template"]["spec"]["containers"][0]["command"] == [
        c.replace("$", "$$") for c in SAMPLE_COMMAND
    ]


# -- Kafka -------------------------------------------------------------------------------


def test_bootstrap_address_is_the_overlays(overlay: str, objects: tuple[Obj, ...]) -> None:
    env = config_map(objects, "harnessrl-env")["data"]
    bootstrap = env["HARNESSRL_KAFKA__BOOTSTRAP_SERVERS"]
    strimzi = [o for o in objects if o["apiVersion"].startswith(STRIMZI_GROUP)]
    if overlay != "strimzi":
        assert not strimzi
        assert bootstrap != "kafka:9092", "the overlay must set its own address"
        return
    (kafka,) = [o for o in strimzi if o["kind"] == "Kafka"]
    pools = [o for o in strimzi if o["kind"] == "KafkaNodePool"]
    assert kafka["apiVersion"] == "kafka.strimzi.io/v1beta2"
    name = kafka["metadata"]["name"]
    assert bootstrap == f"{name}-kafka-bootstrap:9092"
    listeners = {(x["port"], x["type"], x["tls"]) for x in kafka["spec"]["kafka"]["listeners"]}
    assert (9092, "internal", False) in listeners
    assert pools and all(p["metadata"]["labels"]["strimzi.io/cluster"] == name for p in pools)
    roles = {r for p in pools for r in p["spec"]["roles"]}
    assert roles == {"broker", "controller"}
    assert kafka["spec"]["kafka"]["config"]["message.max.bytes"] >= 16 * 1024 * 1024


# -- the multi-node trainer --------------------------------------------------------------


def trainer_pods(objects: tuple[Obj, ...]) -> tuple[Obj, Obj, Obj, int]:
    """(workload, pod spec, trainer container, node count) of a multi-node overlay."""
    (workload,) = [w for w, _ in workloads(objects) if w["metadata"]["name"] == "trainer"]
    spec, pod = workload["spec"], workload["spec"]["template"]["spec"]
    if workload["kind"] == "StatefulSet":
        nodes = spec["replicas"]
    else:
        assert spec["completionMode"] == "Indexed", "a Job's pods need their index"
        assert spec["parallelism"] == spec["completions"], "every rank must run at once"
        nodes = spec["completions"]
    (container,) = pod["containers"]
    return workload, pod, container, int(nodes)


def pod_metadata(workload: Obj, index: int) -> tuple[str, dict[str, str], dict[str, str]]:
    """(hostname, labels, annotations) of the workload's pod `index` as its controller makes
    it (Kubernetes 1.28 and later: the pod-index and completion-index labels)."""
    name = workload["metadata"]["name"]
    labels = dict(workload["spec"]["template"]["metadata"]["labels"])
    annotations: dict[str, str] = {}
    if workload["kind"] == "StatefulSet":
        labels["statefulset.kubernetes.io/pod-name"] = f"{name}-{index}"
        labels["apps.kubernetes.io/pod-index"] = str(index)
    else:
        labels["batch.kubernetes.io/job-name"] = name
        labels["batch.kubernetes.io/job-completion-index"] = str(index)
        annotations["batch.kubernetes.io/job-completion-index"] = str(index)
    return f"{name}-{index}", labels, annotations


def pod_fields(workload: Obj, index: int) -> dict[str, str]:
    """What the downward API gives pod `index` of `workload` (fieldRef paths)."""
    hostname, labels, annotations = pod_metadata(workload, index)
    return {
        "status.podIP": f"10.1.2.{10 + index}",
        "metadata.name": hostname,
        "metadata.namespace": NAMESPACE,
        **{f"metadata.labels['{k}']": v for k, v in labels.items()},
        **{f"metadata.annotations['{k}']": v for k, v in annotations.items()},
    }


def torchrun_args(container: Obj, env: dict[str, str]) -> argparse.Namespace:
    """The container's torchrun arguments, $(VAR) expanded as the kubelet does, parsed by
    torchrun's own parser."""
    from torch.distributed.run import get_args_parser

    assert container["command"] == ["torchrun"]
    words = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], w) for w in container["args"]]
    return get_args_parser().parse_args(words)


def mount_of(container: Obj, path: str) -> Obj:
    """The volume mount `path` lies on (the deepest that holds it)."""
    found = [
        m
        for m in container.get("volumeMounts", [])
        if path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert found, f"nothing is mounted at {path} in {container['name']}"
    return max(found, key=lambda m: len(m["mountPath"]))


def peer_matches(peer: Obj, labels: dict[str, str]) -> bool:
    """Whether a NetworkPolicy peer covers a pod with `labels` in this namespace."""
    assert "ipBlock" not in peer, f"not modelled here: {peer}"
    namespaces = peer.get("namespaceSelector", {}).get("matchLabels", {})
    if not selects(namespaces, {"kubernetes.io/metadata.name": NAMESPACE}):
        return False
    if "podSelector" not in peer:
        return True  # a namespaceSelector alone: every pod of the namespace
    return selects(peer["podSelector"].get("matchLabels", {}), labels)


def port_matches(rule: Obj, port: int) -> bool:
    """Whether a NetworkPolicy rule covers TCP `port` (no ports: every port)."""
    if "ports" not in rule:
        return True
    for entry in rule["ports"]:
        assert isinstance(entry["port"], int), f"named ports not modelled here: {entry}"
        last = entry.get("endPort", entry["port"])
        if entry.get("protocol", "TCP") == "TCP" and entry["port"] <= port <= last:
            return True
    return False


def connects(
    objects: tuple[Obj, ...], source: dict[str, str], target: dict[str, str], port: int
) -> bool:
    """Whether the NetworkPolicies let a pod labelled `source` open a TCP connection to
    `port` of a pod labelled `target` (both in this namespace): the source's egress and the
    target's ingress must each be unrestricted (no policy selects the pod) or allow it."""
    for direction, pod, other, peers in (
        ("Egress", source, target, "to"),
        ("Ingress", target, source, "from"),
    ):
        policies = [
            policy["spec"]
            for policy in kinds(objects, "NetworkPolicy")
            if direction in policy["spec"]["policyTypes"]
            and selects(policy["spec"]["podSelector"].get("matchLabels", {}), pod)
        ]
        if not policies:
            continue  # an unselected pod is not isolated in that direction
        rules = [rule for spec in policies for rule in spec.get(direction.lower()) or []]
        if not any(
            port_matches(rule, port)
            and (peers not in rule or any(peer_matches(p, other) for p in rule[peers]))
            for rule in rules
        ):
            return False
    return True


def named_labels(objects: tuple[Obj, ...], workload: str) -> dict[str, str]:
    (found,) = [w for w, _ in workloads(objects) if w["metadata"]["name"] == workload]
    return dict(found["spec"]["template"]["metadata"]["labels"])


@pytest.fixture
def healthz() -> Iterator[tuple[int, list[int]]]:
    """A real HTTP server on a loopback port answering GET /healthz with status[0]."""
    status = [200]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status[0] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], status
    server.shutdown()
    server.server_close()
    thread.join()


def test_multinode_trainer_pods_are_the_nodes_of_one_torchrun_job(multinode: str) -> None:
    objects = _render(multinode)
    workload, pod, container, nodes = trainer_pods(objects)
    assert nodes >= 2
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    if workload["kind"] == "StatefulSet":
        subdomain = workload["spec"]["serviceName"]
        # Every pod at once: pod 0 is ready only when all ranks have joined it, so ordered
        # start-up would wait for it forever before starting pod 1.
        assert workload["spec"]["podManagementPolicy"] == "Parallel"
    else:
        subdomain = pod["subdomain"]
    ranks = named(objects, "Service", subdomain)
    assert ranks["spec"]["clusterIP"] == "None"
    assert ranks["spec"]["publishNotReadyAddresses"] is True  # the ranks meet before ready
    leader, _, _ = pod_metadata(workload, 0)
    node_ranks = []
    for index in range(nodes):
        hostname, labels, _ = pod_metadata(workload, index)
        assert selects(ranks["spec"]["selector"], labels), f"{hostname} has no DNS name"
        env = container_env(objects, container, pod_fields(workload, index))
        args = torchrun_args(container, env)
        # Static rendezvous keeps the node ranks given, so global rank 0 is on pod 0.
        assert args.rdzv_backend == "static"
        assert args.nnodes == str(nodes), "NNODES must equal the pod count"
        assert args.nproc_per_node == str(gpus), "one rank per GPU of the pod"
        assert args.master_addr == f"{leader}.{subdomain}.{NAMESPACE}.svc"
        assert args.master_port == RANK_PORT
        assert args.module and args.training_script == "harnessrl.services.trainer"
        assert not args.training_script_args  # its config: $HARNESSRL_CONFIG
        node_ranks.append(args.node_rank)
    assert node_ranks == list(range(nodes)), "pod i must be node rank i"

    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mount_of(container, "/dev/shm")["name"]]["emptyDir"]["medium"] == "Memory"
    stack = named(objects, "Deployment", "controller")["spec"]["template"]["spec"]
    assert container["image"] == stack["containers"][0]["image"]


def test_multinode_checkpoints_and_model_are_on_readwritemany_claims(
    multinode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = _render(multinode)
    workload, pod, container, _ = trainer_pods(objects)
    config = load_service_config(objects, pod, container, tmp_path, monkeypatch)
    assert isinstance(config, TrainerConfig)
    assert not workload["spec"].get("volumeClaimTemplates"), "a claim per pod is not shared"
    volumes = {v["name"]: v for v in pod["volumes"]}
    # Every rank writes its shards of each checkpoint and reads the initial policy.
    for path in (str(config.trainer.checkpoint_dir), str(config.trainer.model)):
        claim = volumes[mount_of(container, path)["name"]]["persistentVolumeClaim"]["claimName"]
        modes = named(objects, "PersistentVolumeClaim", claim)["spec"]["accessModes"]
        assert modes == ["ReadWriteMany"], f"{path} is on {claim}, {modes}"
    # The engine is no longer pinned to a trainer's node (whose GPUs the ranks hold).
    engine = named(objects, "Deployment", "inference")["spec"]["template"]["spec"]
    assert "podAffinity" not in (engine.get("affinity") or {})


def test_multinode_trainer_service_selects_pod_zero_only(multinode: str) -> None:
    objects = _render(multinode)
    workload, _, _, nodes = trainer_pods(objects)
    selector = named(objects, "Service", "trainer")["spec"]["selector"]
    chosen = [i for i in range(nodes) if selects(selector, pod_metadata(workload, i)[1])]
    assert chosen == [0], f"the trainer Service (WeightSync, /metrics) selects pods {chosen}"


def test_multinode_network_policy_lets_ranks_talk_and_keeps_others_off_rank_ports(
    multinode: str,
) -> None:
    objects = _render(multinode)
    workload, _, container, nodes = trainer_pods(objects)
    pods = [pod_metadata(workload, i)[1] for i in range(nodes)]
    for source in pods:
        for target in pods:
            for port in (RANK_PORT, NCCL_PORT):
                assert source is target or connects(objects, source, target, port), port
    leader = pods[0]
    engine = named_labels(objects, "inference")
    harness = rendered_job(objects)["spec"]["template"]["metadata"]["labels"]
    for port in (port_number(container, "http"), port_number(container, "grpc-weights")):
        assert connects(objects, engine, leader, port), f"engines to {port}"
    for port in (RANK_PORT, NCCL_PORT):
        assert not connects(objects, engine, leader, port), f"rank port {port}"
        assert not connects(objects, harness, leader, port), f"rank port {port}"
    assert connects(objects, harness, named_labels(objects, "gateway"), 8000)


def test_multinode_job_trains_max_steps_then_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = _render("trainer-multinode-job")
    _, pod, container, _ = trainer_pods(objects)
    config = load_service_config(objects, pod, container, tmp_path, monkeypatch)
    assert isinstance(config, TrainerConfig)
    assert config.trainer.max_steps is not None, "a finite run needs trainer.max_steps"
    assert config.trainer.at_max_steps == "exit", "rank 0 must exit for the Job to complete"
    assert pod["restartPolicy"] in ("OnFailure", "Never")


def test_multinode_probe_checks_healthz_on_node_rank_zero_only(
    multinode: str, tmp_path: Path, healthz: tuple[int, list[int]]
) -> None:
    objects = _render(multinode)
    _, pod, container, _ = trainer_pods(objects)
    probes = {tuple(container[p]["exec"]["command"]) for p in PROBES}
    assert len(probes) == 1, "startup, liveness and readiness probes differ"
    ((_, script, _),) = probes
    local = tmp_path / "healthz.py"
    local.write_text(mounted_file(objects, pod, container, script))
    port, status = healthz
    closed = socket.socket()  # bound, never listening: connections to it are refused
    closed.bind(("127.0.0.1", 0))

    def probe(node_rank: str, at: int) -> int:
        env = {"NODE_RANK": node_rank, "PATH": os.environ.get("PATH", "")}
        run = [sys.executable, str(local), str(at)]
        return subprocess.run(run, env=env, capture_output=True, timeout=30, check=False).returncode

    with closed:
        assert probe("0", port) == 0
        status[0] = 503  # the service's answer when its training task has died
        assert probe("0", port) != 0
        assert probe("0", closed.getsockname()[1]) != 0  # not serving (yet)
        assert probe("1", closed.getsockname()[1]) == 0  # the other nodes serve nothing


# -- the Kubernetes OpenAPI schemas --------------------------------------------------------


def test_objects_match_the_kubernetes_openapi_schemas(objects: tuple[Obj, ...]) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (the dev extra) is not installed"
    )
    version = kubernetes_validate.latest_version()  # schemas it bundles: no network needed
    checked, errors = 0, []
    for obj in [*objects, rendered_job(objects)]:
        if obj["apiVersion"].startswith(STRIMZI_GROUP):
            # Strimzi's Kafka and KafkaNodePool are CRDs: kubernetes-validate bundles no
            # schema for them (the operator's CRDs validate them in the cluster).
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            where = ".".join(map(str, err.path))
            errors.append(f"{obj['kind']} {obj['metadata']['name']}: {where}: {err.message}")
        checked += 1
    assert not errors, f"not valid for Kubernetes {version}:\n" + "\n".join(errors)
    assert checked >= len(EXPECTED_WORKLOADS)
