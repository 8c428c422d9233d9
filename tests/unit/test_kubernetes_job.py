"""The Kubernetes runner's pure parts: Job names, template substitution, status reading."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest
import yaml
from kubernetes_asyncio.client.exceptions import ApiException

from harnessrl.services.controller import kubernetes_status as status
from harnessrl.services.controller.kubernetes_api import is_transient
from harnessrl.services.controller.kubernetes_job import (
    JobTemplate,
    TemplateError,
    job_name,
    label_value,
)
from harnessrl.services.controller.runner import LaunchSpec

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
TEMPLATE = """\
apiVersion: batch/v1
kind: Job
metadata:
  annotations:
    note: "episode ${EPISODE_ID} of group ${GROUP_ID}"
spec:
  template:
    spec:
      containers:
        - name: harness
          image: harness:1
          command: ${COMMAND_JSON}
          args: ["--episode", "${EPISODE_ID}", "--argv", "${COMMAND_JSON}", "$${HOME}"]
          env:
            - name: EPISODE
              value: ${EPISODE_ID}
            - name: TASK
              value: "task=${TASK_ID}"
            - name: SHARED
              value: from-template
"""


def make_spec(**overrides: Any) -> LaunchSpec:
    values: dict[str, Any] = {
        "episode_id": "ep-1",
        "attempt": 0,
        "group_id": "g-1",
        "task_id": "t-1",
        "command": ("python", "run.py"),
        "env": {"SHARED": "from-spec", "OPENAI_BASE_URL": "http://gw/v1"},
        "timeout_s": 60.0,
        **overrides,
    }
    return LaunchSpec(**values)


def render(spec: LaunchSpec, template: str = TEMPLATE) -> dict[str, Any]:
    return JobTemplate.parse(template, "ns").render(spec, namespace="ns", ttl_seconds=600)


def shape(node: Any) -> Any:
    """The structure of a document: its keys and list lengths, not its strings."""
    if isinstance(node, dict):
        return {k: shape(v) for k, v in node.items()}
    if isinstance(node, list):
        return [shape(v) for v in node]
    return type(node).__name__


def test_job_name_is_the_episode_and_attempt_when_the_id_is_clean() -> None:
    assert job_name("ep-1", 3) == "hrl-ep-1-3"
    assert job_name("ep-1", 3) == job_name("ep-1", 3)


@pytest.mark.parametrize("episode_id", ["Ep_1", "ép/1", "x" * 200, "---", "a" * 56, "a.b.c"])
def test_job_name_is_a_dns_label_of_at_most_63_characters(episode_id: str) -> None:
    name = job_name(episode_id, 12)
    assert DNS_LABEL.match(name) and len(name) <= 63
    assert name.startswith("hrl-") and name.endswith("-12")


def test_job_names_differ_for_ids_that_clean_up_alike() -> None:
    assert job_name("Ep_1", 0) != job_name("ep-1", 0)
    assert job_name("x" * 100 + "a", 0) != job_name("x" * 100 + "b", 0)
    assert job_name("ep-1", 0) != job_name("ep-1", 1)


@pytest.mark.parametrize("value", ["ok-value", "has space", "x" * 80, "_leading", "ü", ""])
def test_label_value_is_always_valid(value: str) -> None:
    out = label_value(value)
    assert LABEL_VALUE.match(out) and len(out) <= 63
    if LABEL_VALUE.match(value) and len(value) <= 63:
        assert out == value


HOSTILE = [
    'x"\n  evil: true\nkind: Pod',
    "a: b\n- c\n---\nkind: Secret",
    "${TASK_ID}",
    "$${EPISODE_ID}",
    "{{ '${JOB_NAME}' }}",
    "$(HOME) `rm -rf /` \\n \\\" '",
]


@pytest.mark.parametrize("value", HOSTILE)
def test_substituted_values_cannot_change_the_yaml_structure(value: str) -> None:
    benign = render(make_spec())
    hostile = render(make_spec(episode_id=value, group_id=value, task_id=value))

    assert shape(hostile) == shape(benign)
    assert hostile["kind"] == "Job"
    notes = hostile["metadata"]["annotations"]
    assert notes["harnessrl/episode-id"] == value  # exact, and never substituted again
    assert notes["note"] == f"episode {value} of group {value}"
    (container,) = hostile["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    # Kubelet expands $(VAR) in env and args and reads $$ as $: values come out exact.
    assert env["EPISODE"] == value.replace("$", "$$")
    assert env["TASK"] == "task=" + value.replace("$", "$$")
    assert container["args"][1] == value.replace("$", "$$")
    assert yaml.safe_load(yaml.safe_dump(hostile)) == hostile


def test_command_json_becomes_the_list_under_a_key_and_json_text_elsewhere() -> None:
    job = render(make_spec(command=("sh", "-c", 'echo "$HOME"')))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["sh", "-c", 'echo "$$HOME"']
    assert container["args"][3] == '["sh","-c","echo \\"$$HOME\\""]'


def test_double_dollar_keeps_a_literal_placeholder() -> None:
    (container,) = render(make_spec())["spec"]["template"]["spec"]["containers"]
    assert container["args"][4] == "${HOME}"


def test_launch_env_comes_first_and_wins_over_the_template() -> None:
    (container,) = render(make_spec())["spec"]["template"]["spec"]["containers"]
    names = [e["name"] for e in container["env"]]
    assert names == ["SHARED", "OPENAI_BASE_URL", "EPISODE", "TASK"]
    assert container["env"][0]["value"] == "from-spec"


def test_template_backoff_limit_and_restart_policy_are_kept() -> None:
    template = TEMPLATE.replace("spec:\n  template:", "spec:\n  backoffLimit: 2\n  template:")
    template = template.replace(
        "      containers:", "      restartPolicy: OnFailure\n      containers:"
    )
    job = render(make_spec(timeout_s=0.2), template)
    assert job["spec"]["backoffLimit"] == 2
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert job["spec"]["activeDeadlineSeconds"] == 1


def test_harness_pods_get_no_service_links_nor_api_token_unless_the_template_asks() -> None:
    # Service links would put every Service's address (reward, Kafka) in the harness's env.
    pod = render(make_spec())["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    assert pod["automountServiceAccountToken"] is False
    template = TEMPLATE.replace(
        "      containers:",
        "      enableServiceLinks: true\n      automountServiceAccountToken: true\n"
        "      containers:",
    )
    pod = render(make_spec(), template)["spec"]["template"]["spec"]
    assert pod["enableServiceLinks"] is True and pod["automountServiceAccountToken"] is True


def test_placeholder_in_a_key_is_refused() -> None:
    template = TEMPLATE.replace("    note:", "    ${EPISODE_ID}:")
    with pytest.raises(TemplateError, match=r"metadata.annotations.*values only"):
        JobTemplate.parse(template, "ns")


def test_other_namespace_in_the_template_is_refused() -> None:
    template = TEMPLATE.replace(
        "metadata:\n  annotations:", "metadata:\n  namespace: x\n  annotations:"
    )
    with pytest.raises(TemplateError, match="namespace 'x' differs"):
        JobTemplate.parse(template, "ns")


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ApiException(status=503), True),
        (ApiException(status=429), True),
        (ApiException(status=500), True),
        (ApiException(status=403), False),
        (ApiException(status=409), False),
        (ApiException(status=422), False),
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientConnectionError(), True),
        (TimeoutError(), True),
        (ValueError("bad"), False),
        (asyncio.CancelledError(), False),
    ],
)
def test_transient_api_errors_are_told_apart(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def pod(state: dict[str, Any], **status_fields: Any) -> dict[str, Any]:
    container = {"name": "harness", "state": state}
    return {
        "metadata": {"name": "p"},
        "status": {"containerStatuses": [container], **status_fields},
    }


COMPLETE = status.Finish("Complete", "", "")
FAILED = status.Finish("Failed", "BackoffLimitExceeded", "backoff limit")
DEADLINE = status.Finish("Failed", "DeadlineExceeded", "too long")


@pytest.mark.parametrize(
    ("finish", "the_pod", "outcome", "code"),
    [
        (COMPLETE, pod({"terminated": {"exitCode": 0}}), "exited", 0),
        (COMPLETE, None, "exited", 0),
        (FAILED, pod({"terminated": {"exitCode": 2, "reason": "Error"}}), "exited", 2),
        (FAILED, pod({"terminated": {"exitCode": 137, "reason": "OOMKilled"}}), "exited", 137),
        (FAILED, None, "infra_error", None),
        (FAILED, pod({"waiting": {"reason": "ContainerCreating"}}), "infra_error", None),
        (FAILED, pod({"terminated": {"exitCode": 137}}, reason="Evicted"), "infra_error", 137),
        (DEADLINE, None, "timeout", None),
    ],
)
def test_outcome_of_a_finished_job(
    finish: status.Finish, the_pod: dict[str, Any] | None, outcome: str, code: int | None
) -> None:
    assert status.outcome_of(finish, the_pod, "harness")[:2] == (outcome, code)


def test_pending_says_why_the_pod_has_not_started() -> None:
    unscheduled = {
        "metadata": {"name": "p"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "no gpu",
                }
            ],
        },
    }
    assert status.pending(unscheduled, "harness") == status.Pending(
        "pod p not scheduled: Unschedulable: no gpu", fatal=False
    )
    assert status.pending(None, "harness").fatal is False
    assert status.pending(pod({"waiting": {"reason": "InvalidImageName"}}), "harness").fatal
    assert not status.started(pod({"waiting": {"reason": "ContainerCreating"}}), "harness")
    assert status.started(pod({"running": {}}), "harness")
    restarting = pod({"waiting": {"reason": "CrashLoopBackOff"}})
    restarting["status"]["containerStatuses"][0]["lastState"] = {"terminated": {"exitCode": 1}}
    assert status.started(restarting, "harness")  # OnFailure: it ran, and will run again


def test_env_value_that_is_not_a_string_is_refused() -> None:
    template = TEMPLATE.replace("value: from-template", "value: 8080")
    with pytest.raises(TemplateError, match="SHARED: value must be a string"):
        JobTemplate.parse(template, "ns")
