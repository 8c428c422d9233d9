"""The Kubernetes runner against a stand-in Kubernetes API server (tests/k8s_standin.py).

The API server is a hand-written stand-in because no Kubernetes cluster can run here; the
client is the real kubernetes_asyncio over real HTTP on loopback, so requests, selectors,
watch streams, status codes and JSON shapes go through the same code as against a cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import pytest_asyncio

from harnessrl.services.controller.kubernetes import KubernetesRunner, KubernetesSettings
from harnessrl.services.controller.kubernetes_job import TemplateError, job_name
from harnessrl.services.controller.runner import LaunchError, LaunchSpec
from tests.helpers import eventually
from tests.k8s_standin import KubeStandin, Script

pytestmark = pytest.mark.integration

NAMESPACE = "harness"
TEMPLATE = """\
apiVersion: batch/v1
kind: Job
metadata:
  labels:
    team: rl
spec:
  template:
    metadata:
      labels:
        app: harness
        app.kubernetes.io/component: harness
    spec:
      automountServiceAccountToken: false
      containers:
        - name: harness
          image: registry.example/harness:1
          command: ${COMMAND_JSON}
          env:
            - name: OPENAI_BASE_URL
              value: http://template-default/v1
            - name: EPISODE
              value: ${EPISODE_ID}
            - name: FROM_TEMPLATE
              value: kept
        - name: sidecar
          image: registry.example/sidecar:1
          args: ["--job", "${JOB_NAME}", "--task", "${TASK_ID}"]
"""
RESULT = 'HARNESSRL_RESULT {"answer": 42}'


@pytest_asyncio.fixture
async def standin() -> AsyncIterator[KubeStandin]:
    server = KubeStandin(NAMESPACE)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def make_settings(tmp_path: Path, template: str = TEMPLATE, **overrides: Any) -> KubernetesSettings:
    path = tmp_path / "job.yaml"
    path.write_text(template)
    values: dict[str, Any] = {
        "namespace": NAMESPACE,
        "job_template": path,
        "poll_interval_s": 0.05,
        "resync_interval_s": 0.5,
        "timeout_grace_s": 5.0,
        "pending_timeout_s": 10.0,
        **overrides,
    }
    return KubernetesSettings(**values)


@asynccontextmanager
async def runner_on(
    standin: KubeStandin, settings: KubernetesSettings
) -> AsyncIterator[KubernetesRunner]:
    runner = KubernetesRunner(settings, configuration=standin.configuration())
    await runner.start()
    try:
        yield runner
    finally:
        await runner.stop()


def spec(episode_id: str = "ep-1", attempt: int = 0, timeout_s: float = 30.0) -> LaunchSpec:
    return LaunchSpec(
        episode_id=episode_id,
        attempt=attempt,
        group_id="group-1",
        task_id="task-7",
        command=("python", "harness.py", "--flag"),
        env={"OPENAI_BASE_URL": "http://gateway/e/tok/v1", "HARNESSRL_TASK": '{"q": "$(HOME)"}'},
        timeout_s=timeout_s,
    )


async def test_launch_creates_job_with_name_labels_env_ttl_and_deadline(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(log=RESULT)
    async with runner_on(standin, make_settings(tmp_path, ttl_seconds_after_finished=120)) as r:
        run = await r.launch(spec("Ep_1", attempt=2, timeout_s=12.5))
        await run.wait()

    (job,) = standin.created
    name = job["metadata"]["name"]
    assert name == run.ref == job_name("Ep_1", 2)
    assert name.startswith("hrl-ep-1-") and name.endswith("-2") and len(name) <= 63
    for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "harnessrl"
        assert meta["labels"]["harnessrl/episode-id"] == "Ep_1"
        assert meta["labels"]["harnessrl/attempt"] == "2"
        assert meta["labels"]["harnessrl/group-id"] == "group-1"
        assert meta["annotations"]["harnessrl/episode-id"] == "Ep_1"
        assert meta["annotations"]["harnessrl/task-id"] == "task-7"
    assert job["metadata"]["labels"]["team"] == "rl"
    assert job["spec"]["template"]["metadata"]["labels"]["app"] == "harness"
    assert job["spec"]["ttlSecondsAfterFinished"] == 120
    assert job["spec"]["activeDeadlineSeconds"] == 13
    assert job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    harness, sidecar = pod["containers"]
    assert harness["command"] == ["python", "harness.py", "--flag"]
    assert sidecar["args"] == ["--job", name, "--task", "task-7"]
    for container in (harness, sidecar):
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["OPENAI_BASE_URL"] == "http://gateway/e/tok/v1"  # the LaunchSpec wins
        assert env["HARNESSRL_TASK"] == '{"q": "$$(HOME)"}'  # kubelet reads $$ as $
    harness_env = {e["name"]: e["value"] for e in harness["env"]}
    assert harness_env["FROM_TEMPLATE"] == "kept"
    assert harness_env["EPISODE"] == "Ep_1"


async def test_run_follows_job_to_completion_and_reads_result_from_log(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(log=f"starting\nthinking\n{RESULT}\n", run_s=0.3)
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        run = await runner.launch(spec())
        result = await run.wait()
        assert await run.wait() == result  # safe to call again

    assert result.outcome == "exited"
    assert result.exit_code == 0
    assert orjson.loads(result.result_json or "") == {"answer": 42}
    assert result.result_error is None
    assert result.artifacts_uri == f"k8s://{NAMESPACE}/jobs/{run.ref}"
    assert result.finished_at >= result.started_at
    assert any("watch=" in query for _, _, query in standin.requests)


async def test_nonzero_exit_code_is_reported(standin: KubeStandin, tmp_path: Path) -> None:
    standin.default = Script(exit_code=3, log="Traceback ...\nValueError: boom\n")
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        result = await (await runner.launch(spec())).wait()

    assert result.outcome == "exited"
    assert result.exit_code == 3
    assert result.result_json is None
    assert result.result_error is None


async def test_malformed_result_line_gives_result_error(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(log='HARNESSRL_RESULT {"answer": \n')
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        result = await (await runner.launch(spec())).wait()

    assert result.outcome == "exited"
    assert result.result_json is None
    assert result.result_error is not None
    assert result.result_error.startswith("malformed result")


async def test_result_larger_than_cap_is_truncated(standin: KubeStandin, tmp_path: Path) -> None:
    standin.default = Script(
        log=f"HARNESSRL_RESULT {orjson.dumps({'text': 'x' * 5000}).decode()}\n"
    )
    async with runner_on(standin, make_settings(tmp_path, result_cap_bytes=100)) as runner:
        result = await (await runner.launch(spec())).wait()

    assert result.result_truncated
    assert result.result_json is not None and len(result.result_json) == 100


async def test_result_line_longer_than_log_tail_is_an_error(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(
        log=f"HARNESSRL_RESULT {orjson.dumps({'text': 'x' * 5000}).decode()}\n"
    )
    async with runner_on(standin, make_settings(tmp_path, log_tail_bytes=1024)) as runner:
        result = await (await runner.launch(spec())).wait()

    assert result.result_json is None
    assert result.result_error is not None and "log_tail_bytes" in result.result_error


async def test_hanging_job_is_deleted_at_the_timeout(standin: KubeStandin, tmp_path: Path) -> None:
    standin.default = Script(run_s=None, enforce_deadline=False, log="working...\n")
    settings = make_settings(tmp_path, timeout_grace_s=0.2)
    async with runner_on(standin, settings) as runner:
        run = await runner.launch(spec(timeout_s=0.3))
        result = await run.wait()

    assert result.outcome == "timeout"
    assert "timeout" in result.message
    assert result.finished_at - result.started_at >= 0.5
    assert run.ref not in standin.jobs
    assert (run.ref, "Background") in standin.deletes
    assert not standin.pods


async def test_deadline_exceeded_is_reported_as_timeout(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(run_s=None)  # Kubernetes ends it at activeDeadlineSeconds
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        result = await (await runner.launch(spec(timeout_s=0.5))).wait()

    assert result.outcome == "timeout"
    assert "DeadlineExceeded" in result.message or "activeDeadlineSeconds" in result.message
    assert result.exit_code is None


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("unschedulable", "Insufficient nvidia.com/gpu"),
        ("image_pull_backoff", "ImagePullBackOff"),
        ("invalid_image", "InvalidImageName"),
    ],
)
async def test_pod_that_never_starts_is_infra_error(
    standin: KubeStandin, tmp_path: Path, schedule: Any, expected: str
) -> None:
    standin.default = Script(schedule=schedule)
    async with runner_on(standin, make_settings(tmp_path, pending_timeout_s=0.5)) as runner:
        run = await runner.launch(spec())
        result = await run.wait()

    assert result.outcome == "infra_error"
    assert expected in result.message
    assert result.exit_code is None
    assert run.ref not in standin.jobs  # deleted: it must not start later, unfollowed


async def test_invalid_image_fails_without_waiting_for_pending_timeout(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(schedule="invalid_image")
    async with runner_on(standin, make_settings(tmp_path, pending_timeout_s=60)) as runner:
        result = await (await runner.launch(spec())).wait()

    assert result.outcome == "infra_error"
    assert result.finished_at - result.started_at < 10


async def test_evicted_pod_is_infra_error(standin: KubeStandin, tmp_path: Path) -> None:
    standin.default = Script(evict=True, log="working...\n")
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        result = await (await runner.launch(spec())).wait()

    assert result.outcome == "infra_error"
    assert "evicted" in result.message


async def test_job_deleted_out_of_band_is_infra_error(standin: KubeStandin, tmp_path: Path) -> None:
    standin.default = Script(run_s=None)
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        run = await runner.launch(spec())
        await eventually(lambda: bool(standin.pods), timeout=5)
        standin.delete_job(run.ref)
        result = await run.wait()

    assert result.outcome == "infra_error"
    assert "deleted" in result.message


async def test_kill_deletes_job_and_wait_returns_abandoned(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(run_s=None)
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        run = await runner.launch(spec())
        await eventually(lambda: bool(standin.pods), timeout=5)
        waiting = asyncio.create_task(run.wait())
        await run.kill("policy too stale")
        result = await waiting

    assert result.outcome == "abandoned"
    assert result.message == "policy too stale"
    assert run.ref not in standin.jobs
    assert not standin.pods


async def test_recover_adopts_jobs_left_by_a_previous_runner(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.scripts["done"] = Script(log=RESULT, run_s=0.05)
    standin.scripts["slow"] = Script(log=RESULT, run_s=1.0)
    standin.scripts["collected"] = Script(log=RESULT, run_s=0.05)
    keep = make_settings(tmp_path, delete_after_collect=False)
    async with runner_on(standin, keep) as first:
        done = await first.launch(spec("done"))
        slow = await first.launch(spec("slow"))
        collected = await first.launch(spec("collected"))
        assert (await collected.wait()).outcome == "exited"
        await eventually(lambda: "conditions" in standin.jobs[done.ref]["status"], timeout=5)
    # The first runner is gone without waiting for "done" and "slow".

    async with runner_on(standin, keep) as second:
        runs = await second.recover()
        assert sorted(r.episode_id for r in runs) == ["done", "slow"]
        results = {r.episode_id: await r.wait() for r in runs}

    assert {r.ref for r in runs} == {done.ref, slow.ref}
    for result in results.values():
        assert result.outcome == "exited"
        assert orjson.loads(result.result_json or "") == {"answer": 42}
    assert all(
        standin.jobs[r.ref]["metadata"]["labels"]["harnessrl/collected"] == "true" for r in runs
    )


async def test_job_is_deleted_after_collection(standin: KubeStandin, tmp_path: Path) -> None:
    standin.default = Script(log=RESULT)
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        run = await runner.launch(spec())
        await run.wait()

    assert run.ref not in standin.jobs
    assert (run.ref, "Background") in standin.deletes
    assert not standin.pods


async def test_job_is_kept_and_marked_collected_when_delete_after_collect_is_off(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(log=RESULT)
    async with runner_on(standin, make_settings(tmp_path, delete_after_collect=False)) as runner:
        run = await runner.launch(spec())
        await run.wait()
        assert await runner.recover() == []

    assert standin.jobs[run.ref]["metadata"]["labels"]["harnessrl/collected"] == "true"
    assert not standin.deletes


async def test_conflict_on_create_adopts_the_existing_job(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(log=RESULT, run_s=0.3)
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        first = await runner.launch(spec())
        second = await runner.launch(spec())  # same episode and attempt: 409, adopted
        result = await second.wait()

    assert second.ref == first.ref
    assert len(standin.created) == 2 and len(standin.jobs) == 0
    assert result.outcome == "exited"
    assert orjson.loads(result.result_json or "") == {"answer": 42}


async def test_conflict_with_another_episodes_job_is_launch_error(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(run_s=None)
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        run = await runner.launch(spec("ep-1"))
        standin.jobs[run.ref]["metadata"]["annotations"]["harnessrl/episode-id"] = "someone-else"
        with pytest.raises(LaunchError, match="belongs to episode 'someone-else'"):
            await runner.launch(spec("ep-1"))


async def test_api_refusal_on_create_is_launch_error(standin: KubeStandin, tmp_path: Path) -> None:
    standin.create_error = 403
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        with pytest.raises(LaunchError, match="403"):
            await runner.launch(spec())


async def test_unreachable_api_on_create_is_launch_error(tmp_path: Path) -> None:
    server = KubeStandin(NAMESPACE)
    await server.start()
    configuration = server.configuration()
    await server.stop()
    runner = KubernetesRunner(make_settings(tmp_path), configuration=configuration)
    await runner.start()
    try:
        with pytest.raises(LaunchError):
            await runner.launch(spec())
    finally:
        await runner.stop()


def job_reads(standin: KubeStandin, name: str) -> int:
    path = f"/apis/batch/v1/namespaces/{NAMESPACE}/jobs/{name}"
    return sum(1 for method, p, _ in standin.requests if method == "GET" and p == path)


async def test_runs_follow_their_job_through_the_watch(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.default = Script(log=RESULT, run_s=0.2)
    settings = make_settings(tmp_path, poll_interval_s=60.0, resync_interval_s=60.0)
    async with runner_on(standin, settings) as runner:
        await eventually(lambda: standin.watchers() == 1, timeout=5)
        async with asyncio.timeout(20):  # well before any poll would happen
            run = await runner.launch(spec())
            result = await run.wait()

    assert result.outcome == "exited"
    assert job_reads(standin, run.ref) == 0


def watch_versions(standin: KubeStandin) -> list[str | None]:
    """The resourceVersion each watch request resumed from (None: from scratch)."""
    versions: list[str | None] = []
    for method, _, query in standin.requests:
        if method == "GET" and "watch=" in query:
            found = [
                p.split("=", 1)[1] for p in query.split("&") if p.startswith("resourceVersion=")
            ]
            versions.append(found[0] if found else None)
    return versions


@pytest.mark.parametrize("expired", [0, 1])
async def test_watch_reopens_where_it_ended_and_restarts_when_expired(
    standin: KubeStandin, tmp_path: Path, expired: int
) -> None:
    standin.expire_versions = expired
    standin.default = Script(log=RESULT, run_s=1.6)
    settings = make_settings(
        tmp_path, poll_interval_s=60.0, resync_interval_s=60.0, watch_timeout_s=1
    )
    async with runner_on(standin, settings) as runner:
        await eventually(lambda: standin.watchers() == 1, timeout=5)
        async with asyncio.timeout(20):  # well before any poll would happen
            run = await runner.launch(spec())
            result = await run.wait()

    assert result.outcome == "exited"
    versions = watch_versions(standin)
    assert versions[0] is None and any(v is not None for v in versions[1:])
    assert versions.count(None) == 1 + expired  # after 410 Gone: from scratch again


@pytest.mark.parametrize("watch_error", [500, 403])
async def test_runs_finish_by_polling_when_the_watch_fails(
    standin: KubeStandin, tmp_path: Path, watch_error: int
) -> None:
    standin.watch_error = watch_error
    standin.default = Script(log=RESULT, run_s=0.2)
    async with runner_on(standin, make_settings(tmp_path)) as runner:
        run = await runner.launch(spec())
        result = await run.wait()

    assert result.outcome == "exited"
    assert orjson.loads(result.result_json or "") == {"answer": 42}
    assert job_reads(standin, run.ref) > 0


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("kind: Job\napiVersion: v1\n", "apiVersion batch/v1, kind Job"),
        ("apiVersion: batch/v1\nkind: Job\nspec: {template: {spec: {}}}\n", "containers"),
        ("[1, 2", "not valid YAML"),
        (TEMPLATE.replace("${TASK_ID}", "${TASK}"), "unknown placeholder ${TASK}"),
        (
            TEMPLATE.replace("image: registry.example/sidecar:1", "imagePullPolicy: Always"),
            "has no image",
        ),
        (
            TEMPLATE.replace("metadata:\n  labels:", "metadata:\n  name: fixed\n  labels:"),
            "metadata.name",
        ),
        (
            TEMPLATE.replace("spec:\n  template:", "spec:\n  parallelism: 4\n  template:"),
            "parallelism",
        ),
    ],
)
def test_bad_template_is_refused_with_a_clear_message(
    tmp_path: Path, template: str, expected: str
) -> None:
    with pytest.raises(TemplateError, match=r"job template .*job\.yaml") as info:
        KubernetesRunner(make_settings(tmp_path, template=template))
    assert expected in str(info.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (("        app.kubernetes.io/component: harness\n", ""), "NetworkPolicy"),
        (("      automountServiceAccountToken: false\n", ""), "automountServiceAccountToken"),
        (
            ("      containers:", "      hostNetwork: true\n      containers:"),
            "hostNetwork is true",
        ),
        (
            (
                "            - name: FROM_TEMPLATE\n",
                "            - name: STOLEN\n              valueFrom:\n                "
                "secretKeyRef: {name: harnessrl-secrets, key: admin-token}\n"
                "            - name: FROM_TEMPLATE\n",
            ),
            "takes Kubernetes Secrets into its environment: ['STOLEN']",
        ),
    ],
    ids=["not-under-the-network-policy", "api-token", "host-network", "secret-env"],
)
def test_a_template_that_would_not_contain_harnesses_is_refused_unless_allowed(
    tmp_path: Path, change: tuple[str, str], expected: str
) -> None:
    assert change[0] in TEMPLATE
    template = TEMPLATE.replace(*change)
    with pytest.raises(TemplateError, match="harness pods would not be contained") as info:
        KubernetesRunner(make_settings(tmp_path, template=template))
    assert expected in str(info.value)
    assert "controller.kubernetes.allow_uncontained" in str(info.value)
    KubernetesRunner(make_settings(tmp_path, template=template, allow_uncontained=True))


def test_missing_template_file_is_refused(tmp_path: Path) -> None:
    settings = make_settings(tmp_path).model_copy(update={"job_template": tmp_path / "nope.yaml"})
    with pytest.raises(TemplateError, match=r"nope\.yaml: cannot be read"):
        KubernetesRunner(settings)
