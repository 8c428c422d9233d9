"""Container images and Kubernetes Job templates for synthesized tasks: what `swe synth`
writes under out/deploy/ so the harness runs as a Kubernetes Job per episode.

    out/deploy/<name>-<version>/Dockerfile   one image per project environment
    out/deploy/<name>-<version>/job.yaml     the controller's job_template for it
    out/deploy/README.md                     how to build, push and use them

Each image holds, at the same absolute paths as on the machine that ran synth (so the task
file's `repo` and `environment` hold unchanged inside the pod): the project's environment
(pytest and its test requirements, built from the same pins, never the project), the task
repositories of that project (one commit each, the bug present), the coding harness
(examples/swe: mini-swe-agent from its hash-pinned lock, and the launcher) and git. The
build context is `out/`. Nothing in the image holds the unmutated code: not the pristine
checkout, not the sdist, not the gold patches (the task files stay outside).

The Job runs as an unprivileged user with a read-only root filesystem: the only writable
places are /tmp and the run's directory (emptyDir volumes), so the agent cannot change the
environment its tests run in; the `harness-egress` NetworkPolicy (deploy/k8s) lets the pod
reach the gateway and DNS only.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from harnessrl.apps.swe.env import PYTEST
from harnessrl.apps.swe.projects import Project

HARNESS_DIR = "/opt/harness"
"""Where the image keeps the harness (examples/swe)."""


def dockerfile(project: Project, out: Path, env: Path, repos: list[str]) -> str:
    """The Dockerfile of one project's image; `repos` are task repository directory names
    under out/repos."""
    out = out.resolve()
    env = env.resolve()
    requirements = " ".join(shlex.quote(r) for r in (PYTEST, *project.test_requires))
    lines = [
        f"# The environment of harnessrl's tasks from {project.requirement}, with the",
        "# coding harness. Build from the synth output directory:",
        f"#   docker build -f deploy/{project.name}-{project.version}/Dockerfile "
        f"-t harnessrl-swe-{project.name}:{project.version} .",
        "FROM python:3.11-slim",
        "RUN apt-get update && apt-get install -y --no-install-recommends git \\",
        "    && rm -rf /var/lib/apt/lists/*",
        f"RUN python -m venv {env} \\",
        f"    && {env}/bin/pip install --no-cache-dir --disable-pip-version-check {requirements}",
        "COPY harness/requirements.txt " + f"{HARNESS_DIR}/requirements.txt",
        f"RUN python -m venv {HARNESS_DIR}/.venv \\",
        f"    && {HARNESS_DIR}/.venv/bin/pip install --no-cache-dir --require-hashes "
        f"--no-deps -r {HARNESS_DIR}/requirements.txt",
        f"COPY harness/launch.py {HARNESS_DIR}/launch.py",
    ]
    for name in repos:
        lines.append(f"COPY repos/{name} {out}/repos/{name}")
    lines += [
        "RUN useradd --uid 10001 --create-home agent",
        "USER 10001",
        "WORKDIR /tmp",
        "",
    ]
    return "\n".join(lines)


def job_template(project: Project, image: str) -> str:
    """The controller's `kubernetes.job_template` for this project's image."""
    return f"""# harnessrl harness Job for tasks from {project.requirement} (controller.kubernetes
# .job_template). The controller fills in the placeholders and the episode env
# (OPENAI_BASE_URL, OPENAI_API_KEY, HARNESSRL_TASK, ...). Set controller.harness.command to
#   ["python", "{HARNESS_DIR}/launch.py", "--mini", "{HARNESS_DIR}/.venv/bin/mini"]
# The root filesystem is read-only: the agent writes only its run directory and /tmp.
apiVersion: batch/v1
kind: Job
metadata:
  name: ${{JOB_NAME}}
  labels:
    app.kubernetes.io/part-of: harnessrl
    app.kubernetes.io/component: harness
spec:
  backoffLimit: 0
  template:
    metadata:
      labels:
        app.kubernetes.io/part-of: harnessrl
        app.kubernetes.io/component: harness
    spec:
      restartPolicy: Never
      automountServiceAccountToken: false
      enableServiceLinks: false
      securityContext:
        runAsNonRoot: true
        runAsUser: 10001
        runAsGroup: 10001
        seccompProfile:
          type: RuntimeDefault
      containers:
        - name: harness
          image: {image}
          command: ${{COMMAND_JSON}}
          workingDir: /run/episode
          env:
            - name: HARNESSRL_TASK_ID
              value: ${{TASK_ID}}
            - name: HOME
              value: /tmp
          resources:
            requests:
              cpu: "1"
              memory: 1Gi
            limits:
              cpu: "2"
              memory: 4Gi
              ephemeral-storage: 4Gi
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
          volumeMounts:
            - name: tmp
              mountPath: /tmp
            - name: episode
              mountPath: /run/episode
      volumes:
        - name: tmp
          emptyDir: {{sizeLimit: 1Gi}}
        - name: episode
          emptyDir: {{sizeLimit: 4Gi}}
"""


README = """# Images and Job templates for the synthesized tasks

One directory per project: `Dockerfile` (its environment, its task repositories, the coding
harness) and `job.yaml` (the controller's `kubernetes.job_template` for that image). The
build context is the synth output directory (this directory's parent), into which `harness/`
is copied from examples/swe (requirements.txt and launch.py) by `swe synth`:

    cd OUT && docker build -f deploy/six-1.17.0/Dockerfile -t REGISTRY/harnessrl-swe-six:1.17.0 .
    docker push REGISTRY/harnessrl-swe-six:1.17.0

Edit `image:` in job.yaml to the pushed name, mount it as the controller's job template
(deploy/k8s: the `job-template.yaml` key of the controller's ConfigMap) and set
`controller.harness.command` as the template's header says. A stack trains on one project's
image at a time; for several, build one image per project and run one controller per image,
or merge the Dockerfiles' COPY lines into one image.
"""


def write(project: Project, out: Path, env: Path, harness: Path | None) -> Path:
    """out/deploy/<name>-<version>/{Dockerfile,job.yaml}, and the harness files and the
    README once; returns the project's directory."""
    repos = sorted(p.name for p in (out / "repos").glob(f"{project.name}-{project.version}__*"))
    target = out / "deploy" / f"{project.name}-{project.version}"
    target.mkdir(parents=True, exist_ok=True)
    (target / "Dockerfile").write_text(dockerfile(project, out, env, repos))
    image = f"registry.example.com/harnessrl-swe-{project.name}:{project.version}"
    (target / "job.yaml").write_text(job_template(project, image))
    (out / "deploy" / "README.md").write_text(README)
    if harness is not None:
        copied = out / "harness"
        copied.mkdir(exist_ok=True)
        for name in ("requirements.txt", "launch.py"):
            if (harness / name).is_file():
                (copied / name).write_bytes((harness / name).read_bytes())
    return target
