"""The Kubernetes Job of one harness run: the user's template, filled in for one attempt.

The template is a `batch/v1` Job in YAML. Its string values may hold the placeholders
${EPISODE_ID}, ${ATTEMPT}, ${GROUP_ID}, ${TASK_ID}, ${JOB_NAME} and ${COMMAND_JSON} (the
LaunchSpec command as a JSON array); `$${NAME}` keeps a literal `${NAME}`. A value that is
exactly `${COMMAND_JSON}` under a mapping key (`command: ${COMMAND_JSON}`) becomes the list
itself; anywhere else it is the JSON text.

Substitution happens after the YAML is parsed, inside string scalars, in one pass: a value
can never add a key, end a string or introduce a placeholder, whatever quotes, newlines or
`${...}` it holds. Kubernetes itself expands `$(VAR)` in a container's command, args and env
values, so `$` in a value placed there is written `$$`: the harness sees the exact value.

The runner then owns: the name, the namespace, the harnessrl labels and annotations (Job and
pod template), the LaunchSpec env in every container (its values win over the template's),
`ttlSecondsAfterFinished` and `activeDeadlineSeconds`; `backoffLimit: 0`,
`restartPolicy: Never`, `enableServiceLinks: false` (else Kubernetes writes the address of
every Service in the namespace, the reward service and Kafka among them, into the harness's
environment) and `automountServiceAccountToken: false` (no Kubernetes API credentials in the
harness) unless the template sets them. Everything here is pure.
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import yaml

from harnessrl.services.controller.runner import LaunchSpec

PLACEHOLDERS = frozenset(
    {"EPISODE_ID", "ATTEMPT", "GROUP_ID", "TASK_ID", "JOB_NAME", "COMMAND_JSON"}
)
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "harnessrl"
EPISODE_KEY = "harnessrl/episode-id"
ATTEMPT_KEY = "harnessrl/attempt"
GROUP_KEY = "harnessrl/group-id"
TASK_KEY = "harnessrl/task-id"
TIMEOUT_KEY = "harnessrl/timeout-s"
"""Annotation: the run's timeout in seconds, so a recovering controller enforces it too."""
COLLECTED_LABEL = "harnessrl/collected"
"""Label set on a finished Job whose result was collected (when it is kept)."""

_TOKEN = re.compile(r"\$(\$?)\{([^{}]*)\}")
_COMMAND = "${COMMAND_JSON}"
_EXPANDED_FIELDS = frozenset({"command", "args", "env"})  # kubelet expands $(VAR) in these
_CONTAINER_LISTS = ("initContainers", "containers")
_DNS_INVALID = re.compile(r"[^a-z0-9-]+")
_LABEL_INVALID = re.compile(r"[^A-Za-z0-9._-]+")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_MAX_NAME = 63


HARNESS_LABEL = "app.kubernetes.io/component"
"""The pod label (value "harness") the harness-egress NetworkPolicy selects."""


class TemplateError(ValueError):
    """The Job template is unusable; the message names the file, the field and the reason."""


def job_name(episode_id: str, attempt: int) -> str:
    """`hrl-<episode>-<attempt>`: a DNS-1123 label of at most 63 characters, deterministic.

    When the episode id is not already a clean DNS label (upper case, other characters) or
    is too long, a short hash of the exact id is added so distinct ids keep distinct names.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0, got {attempt}")
    stem = _DNS_INVALID.sub("-", episode_id.lower()).strip("-")
    stem = re.sub("-{2,}", "-", stem)
    tail = f"-{attempt}"
    name = f"hrl-{stem}{tail}"
    if stem == episode_id and len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(episode_id.encode()).hexdigest()[:8]
    room = _MAX_NAME - len("hrl-") - len(tail) - len(digest) - 1
    stem = stem[:room].rstrip("-")
    return f"hrl-{stem}-{digest}{tail}" if stem else f"hrl-{digest}{tail}"


def label_value(value: str) -> str:
    """`value` when it is a valid label value, else a cleaned, hash-suffixed stand-in for it
    (the exact value is kept in an annotation)."""
    if len(value) <= _MAX_NAME and _LABEL_VALUE.match(value):
        return value
    digest = hashlib.sha256(value.encode()).hexdigest()[:8]
    stem = _LABEL_INVALID.sub("_", value)[: _MAX_NAME - len(digest) - 1].strip("._-")
    return f"{stem}-{digest}" if stem else digest


@dataclass(frozen=True, slots=True)
class JobTemplate:
    """A validated Job template; `render()` makes the Job of one run."""

    manifest: Mapping[str, Any]
    source: str
    """Where the template came from (file path), for error messages."""

    @classmethod
    def load(cls, path: Path, namespace: str) -> JobTemplate:
        """Read and validate the template at `path`. Raises TemplateError."""
        try:
            text = path.read_text()
        except OSError as err:
            raise TemplateError(f"job template {path}: cannot be read: {err}") from err
        return cls.parse(text, namespace, source=str(path))

    @classmethod
    def parse(cls, text: str, namespace: str, *, source: str = "<template>") -> JobTemplate:
        """Validate the template text. Raises TemplateError naming what is wrong."""
        try:
            documents = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as err:
            raise TemplateError(f"job template {source}: not valid YAML: {err}") from err
        if len(documents) != 1:
            raise TemplateError(
                f"job template {source}: expected one YAML document, found {len(documents)}"
            )
        manifest = documents[0]
        _validate(manifest, namespace, lambda msg: TemplateError(f"job template {source}: {msg}"))
        return cls(manifest, source)

    def uncontained(self) -> list[str]:
        """How a harness pod made from this template would not be contained, in words ([]
        when it is): the label that puts it under the harness-egress NetworkPolicy (the
        gateway and DNS, nothing else), no service account token, none of the node's
        namespaces, no privilege, no Kubernetes Secret in its environment or volumes."""
        template = self.manifest["spec"]["template"]
        labels = (template.get("metadata") or {}).get("labels") or {}
        pod = template["spec"]
        found = []
        if labels.get(HARNESS_LABEL) != "harness":
            found.append(
                f"spec.template.metadata.labels[{HARNESS_LABEL!r}] is not 'harness' (the "
                "NetworkPolicy that keeps harness pods to the gateway does not select it)"
            )
        if pod.get("automountServiceAccountToken") is not False:
            found.append(
                "spec.template.spec.automountServiceAccountToken is not false (the pod gets "
                "a token for the Kubernetes API)"
            )
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(key):
                found.append(f"spec.template.spec.{key} is true (the node's own namespace)")
        for volume in pod.get("volumes") or []:
            if isinstance(volume, dict) and ("secret" in volume or "projected" in volume):
                found.append(f"spec.template.spec.volumes: {volume.get('name')!r} mounts a Secret")
        for key in _CONTAINER_LISTS:
            for container in pod.get(key) or []:
                where = f"spec.template.spec.{key}[{container.get('name')!r}]"
                context = container.get("securityContext") or {}
                if context.get("privileged") or context.get("allowPrivilegeEscalation"):
                    found.append(f"{where}.securityContext grants privileges")
                refs = [
                    e.get("name")
                    for e in container.get("env") or []
                    if "secretKeyRef" in ((e.get("valueFrom") or {}) if isinstance(e, dict) else {})
                ]
                refs += ["envFrom" for e in container.get("envFrom") or [] if "secretRef" in e]
                if refs:
                    found.append(f"{where} takes Kubernetes Secrets into its environment: {refs}")
        return found

    def render(self, spec: LaunchSpec, *, namespace: str, ttl_seconds: int) -> dict[str, Any]:
        """The Job manifest of `spec` (a new object; the template is not changed)."""
        name = job_name(spec.episode_id, spec.attempt)
        values = {
            "EPISODE_ID": spec.episode_id,
            "ATTEMPT": str(spec.attempt),
            "GROUP_ID": spec.group_id,
            "TASK_ID": spec.task_id,
            "JOB_NAME": name,
            "COMMAND_JSON": orjson.dumps(list(spec.command)).decode(),
        }
        job: dict[str, Any] = _fill(copy.deepcopy(self.manifest), values, spec.command, False)
        labels = {
            MANAGED_BY_LABEL: MANAGED_BY,
            EPISODE_KEY: label_value(spec.episode_id),
            ATTEMPT_KEY: str(spec.attempt),
            GROUP_KEY: label_value(spec.group_id),
        }
        annotations = {
            EPISODE_KEY: spec.episode_id,
            ATTEMPT_KEY: str(spec.attempt),
            GROUP_KEY: spec.group_id,
            TASK_KEY: spec.task_id,
            TIMEOUT_KEY: repr(float(spec.timeout_s)),
        }
        meta = job.setdefault("metadata", {})
        meta.update(name=name, namespace=namespace)
        _merge_meta(meta, labels, annotations)
        job_spec = job["spec"]
        job_spec["ttlSecondsAfterFinished"] = ttl_seconds
        job_spec["activeDeadlineSeconds"] = max(1, math.ceil(spec.timeout_s))
        job_spec.setdefault("backoffLimit", 0)
        pod = job_spec["template"]
        _merge_meta(pod.setdefault("metadata", {}), labels, annotations)
        pod["spec"].setdefault("restartPolicy", "Never")
        pod["spec"].setdefault("enableServiceLinks", False)
        pod["spec"].setdefault("automountServiceAccountToken", False)
        env = [{"name": k, "value": v.replace("$", "$$")} for k, v in spec.env.items()]
        for key in _CONTAINER_LISTS:
            for container in pod["spec"].get(key) or []:
                kept = [e for e in container.get("env") or [] if e["name"] not in spec.env]
                # LaunchSpec entries first: template entries may then refer to them as $(NAME).
                container["env"] = [*copy.deepcopy(env), *kept]
        return job


def harness_container(job: Mapping[str, Any]) -> str:
    """Name of the container whose exit code and log are the run's: the first container."""
    return str(job["spec"]["template"]["spec"]["containers"][0]["name"])


def _merge_meta(meta: dict[str, Any], labels: dict[str, str], notes: dict[str, str]) -> None:
    meta["labels"] = {**(meta.get("labels") or {}), **labels}
    meta["annotations"] = {**(meta.get("annotations") or {}), **notes}


def _substitute(text: str, values: Mapping[str, str], escape: bool) -> str:
    def replace(match: re.Match[str]) -> str:
        if match.group(1):  # $${NAME}: a literal ${NAME}
            return match.group(0)[1:]
        value = values[match.group(2)]
        return value.replace("$", "$$") if escape else value

    return _TOKEN.sub(replace, text)


def _fill(node: Any, values: Mapping[str, str], command: tuple[str, ...], escape: bool) -> Any:
    """`node` with placeholders replaced; `escape`: inside a field kubelet expands."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            inner = escape or (key in _EXPANDED_FIELDS and _in_container(node))
            if value == _COMMAND:
                out[key] = [c.replace("$", "$$") if inner else c for c in command]
            else:
                out[key] = _fill(value, values, command, inner)
        return out
    if isinstance(node, list):
        return [_fill(item, values, command, escape) for item in node]
    if isinstance(node, str):
        return _substitute(node, values, escape)
    return node


def _in_container(node: Mapping[str, Any]) -> bool:
    # A container mapping is the only one with both a name and an image in a pod spec.
    return "name" in node and "image" in node


def _placeholders_in(node: Any, path: str, keys_too: bool = True) -> list[tuple[str, str]]:
    """(path, placeholder name) of every ${NAME} in `node`'s values (and keys)."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if keys_too and isinstance(key, str) and _TOKEN.search(key):
                found.append((where, "<in a key>"))
            found += _placeholders_in(value, where)
    elif isinstance(node, list):
        for i, item in enumerate(node):
            found += _placeholders_in(item, f"{path}[{i}]")
    elif isinstance(node, str):
        found += [(path, m.group(2)) for m in _TOKEN.finditer(node) if not m.group(1)]
    return found


def _validate(manifest: Any, namespace: str, error: Callable[[str], TemplateError]) -> None:
    if not isinstance(manifest, dict):
        raise error(f"must be a mapping (a Job object), got {type(manifest).__name__}")
    if manifest.get("apiVersion") != "batch/v1" or manifest.get("kind") != "Job":
        raise error(
            f"must be apiVersion batch/v1, kind Job; got apiVersion "
            f"{manifest.get('apiVersion')!r}, kind {manifest.get('kind')!r}"
        )
    meta = manifest.get("metadata") or {}
    if not isinstance(meta, dict):
        raise error("metadata must be a mapping")
    if meta.get("name") not in (None, "${JOB_NAME}") or "generateName" in meta:
        raise error("metadata.name is set by the runner: leave it out (or use ${JOB_NAME})")
    if meta.get("namespace") not in (None, namespace):
        raise error(
            f"metadata.namespace {meta['namespace']!r} differs from the runner's namespace "
            f"{namespace!r}: leave it out"
        )
    for where, name in _placeholders_in(manifest, ""):
        if name == "<in a key>":
            raise error(f"{where}: placeholders are allowed in values only, not in keys")
        if name not in PLACEHOLDERS:
            raise error(
                f"{where}: unknown placeholder ${{{name}}} (known: "
                f"{', '.join(sorted(PLACEHOLDERS))}; write $${{{name}}} for a literal)"
            )
    spec = manifest.get("spec")
    if not isinstance(spec, dict):
        raise error("spec is missing or not a mapping")
    for field in ("parallelism", "completions"):
        if spec.get(field, 1) != 1:
            raise error(f"spec.{field} must be 1 (one pod per run), got {spec[field]!r}")
    template = spec.get("template")
    pod = template.get("spec") if isinstance(template, dict) else None
    if not isinstance(pod, dict):
        raise error("spec.template.spec (the pod spec) is missing or not a mapping")
    if pod.get("restartPolicy", "Never") not in ("Never", "OnFailure"):
        raise error(
            f"spec.template.spec.restartPolicy must be Never or OnFailure, "
            f"got {pod['restartPolicy']!r}"
        )
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers:
        raise error("spec.template.spec.containers must be a non-empty list")
    for key in _CONTAINER_LISTS:
        for i, container in enumerate(pod.get(key) or []):
            where = f"spec.template.spec.{key}[{i}]"
            if not isinstance(container, dict) or not container.get("name"):
                raise error(f"{where} must be a mapping with a name")
            if not container.get("image"):
                raise error(f"{where} ({container['name']}) has no image")
            env = container.get("env") or []
            if not isinstance(env, list) or not all(
                isinstance(e, dict) and isinstance(e.get("name"), str) for e in env
            ):
                raise error(f"{where}.env must be a list of mappings with a name")
            for entry in env:
                if "value" in entry and not isinstance(entry["value"], str):
                    raise error(
                        f"{where}.env {entry['name']}: value must be a string (quote it), "
                        f"got {entry['value']!r}"
                    )
