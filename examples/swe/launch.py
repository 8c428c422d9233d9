"""One episode of a coding task with mini-swe-agent: the command the controller runs.

mini-swe-agent runs as released (its `mini` command, installed by install.py into
examples/swe/.venv); this launcher only does what a deployment of it does around each run:

1. reads the task ($HARNESSRL_TASK, or --task-file) and checks it (exit 2 naming the field):

       {"problem_statement": str, "repo": str, "base_commit": str,
        "environment": str | null, "test_command": str | [str] | null,
        "python_path": [str] | null}

   `repo` is an absolute path of a git repository or a URL git can fetch from;
   `base_commit` a commit (a full sha for a URL); `environment` the absolute path of a venv
   with the project's test dependencies, put first on the agent's PATH; `python_path` the
   working copy's directories on the agent's PYTHONPATH (e.g. ["src"]); `test_command`,
   when given, is named in the task text;
2. makes the working copy `repo/` in the run's directory (the cwd): the base commit alone,
   fetched with --depth 1 (no history, so no later commit or earlier state is in reach;
   the task's repository is only read), detached;
3. runs `mini` on it non-interactively (see `mini_argv`): the model is `openai/<name>` at
   $OPENAI_BASE_URL with $OPENAI_API_KEY (the gateway and the episode token the controller
   sets), litellm's bundled cost map instead of a download, cost tracking off, a step limit,
   the trajectory written to `trajectory.json` after every step;
4. when it exits, reports `{"patch": <git diff of the working copy against the base commit,
   new files included>, "exit_status", "model_calls", "base_commit"}` as JSON at
   $HARNESSRL_OUTPUT (else as the last stdout line `HARNESSRL_RESULT <json>`), the patch also
   as `patch.diff` beside it (exact bytes, never cut), and exits with mini's exit status.

A repository that cannot be fetched exits 75 (retryable). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MINI = HERE / ".venv" / "bin" / "mini"
"""Where install.py puts the `mini` command."""
RESULT_PREFIX = "HARNESSRL_RESULT "
COPY = "repo"
TRAJECTORY = "trajectory.json"
PATCH = "patch.diff"
GIT_TIMEOUT_S = 300.0
EX_TASK = 2
EX_TEMPFAIL = 75
LOCAL_EXCLUDES = "__pycache__/\n*.py[co]\n.pytest_cache/\n"
"""Kept out of the patch (in the copy's .git/info/exclude, never in the patch itself): what
running the tests leaves behind in a repository without a .gitignore of its own."""
TRUSTED = ("-c", "safe.directory=*")
"""For the git commands that read the task's repository: it may belong to another user than
the run (a sandboxed run has a uid of its own), which git otherwise refuses."""
OFFLINE_ENV = {
    "MSWEA_CONFIGURED": "true",  # no first-run setup wizard
    "MSWEA_SILENT_STARTUP": "1",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no cost map download at import
    "LITELLM_OFFLINE_MODE": "true",  # nor any other catalog litellm would fetch
    "LITELLM_MODE": "PRODUCTION",  # no search for a .env above litellm's install
}


class TaskError(ValueError):
    """The task input cannot describe a coding task; names the field."""


class GitError(RuntimeError):
    """A git step failed (the repository unreachable, the commit missing)."""


@dataclass(frozen=True, slots=True)
class CodingTask:
    problem_statement: str
    repo: str
    base_commit: str
    environment: Path | None
    test_command: str | None
    """As one shell line (an argv is joined)."""
    python_path: tuple[str, ...]

    @classmethod
    def from_input(cls, data: Any) -> CodingTask:
        """Raises TaskError naming the field."""
        if not isinstance(data, dict):
            raise TaskError(f"input: a JSON object, not {type(data).__name__}")
        problem = _text(data, "problem_statement")
        repo = _text(data, "repo")
        if not _is_url(repo) and not Path(repo).is_absolute():
            raise TaskError("input.repo: an absolute path or a URL")
        commit = _text(data, "base_commit")
        if commit.startswith("-") or any(c.isspace() for c in commit):
            raise TaskError("input.base_commit: not a commit")
        environment = data.get("environment")
        if environment is not None:
            if not isinstance(environment, str) or not Path(environment).is_absolute():
                raise TaskError("input.environment: the absolute path of a venv, or null")
            if not (Path(environment) / "bin").is_dir():
                raise TaskError(f"input.environment: {environment} has no bin/ directory")
        command = data.get("test_command")
        if isinstance(command, list) and all(isinstance(a, str) for a in command):
            command = shlex.join(command)
        if command is not None and not isinstance(command, str):
            raise TaskError("input.test_command: a string, a list of strings, or null")
        python_path = data.get("python_path") or []
        if not isinstance(python_path, list) or not all(
            isinstance(p, str) and p and not Path(p).is_absolute() and ".." not in Path(p).parts
            for p in python_path
        ):
            raise TaskError("input.python_path: a list of directories inside the repository")
        return cls(
            problem_statement=problem,
            repo=repo,
            base_commit=commit,
            environment=Path(environment) if environment else None,
            test_command=command or None,
            python_path=tuple(python_path),
        )

    def text(self) -> str:
        """What mini-swe-agent is asked to do."""
        if self.test_command is None:
            return self.problem_statement
        return f"{self.problem_statement}\n\nThe project's tests run with: {self.test_command}"


def _text(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value.strip():
        raise TaskError(f"input.{name}: required, a non-empty string")
    return value


def _is_url(repo: str) -> bool:
    return "://" in repo or (":" in repo.split("/", 1)[0] and not repo.startswith("/"))


def git(*args: str, cwd: Path | None = None) -> bytes:
    """git's stdout; raises GitError with its message. No inherited GIT_* variable can
    point it at another repository, and it never waits for credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_TERMINAL_PROMPT"] = "0"
    try:
        done = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise GitError(f"git {args[0]}: no answer in {GIT_TIMEOUT_S:g} s") from err
    if done.returncode != 0:
        message = done.stderr.decode(errors="replace").strip()
        raise GitError(f"git {args[0]}: {message or f'exit code {done.returncode}'}")
    return done.stdout


def working_copy(task: CodingTask, dest: Path) -> str:
    """Make `dest` (which must not exist) hold the base commit alone, detached; its sha."""
    if dest.exists():
        raise GitError(f"{dest} exists: each run needs a directory of its own")
    commit = task.base_commit
    if not _is_url(task.repo):
        # A fetch wants a full sha or a ref: resolve names and short shas where the
        # repository is (read only).
        resolve = ("rev-parse", "--verify", "--end-of-options", f"{commit}^{{commit}}")
        try:
            commit = git(*TRUSTED, *resolve, cwd=Path(task.repo)).decode().strip()
        except GitError as err:
            raise TaskError(f"input.base_commit: not a commit of {task.repo}: {err}") from err
    git("init", "--quiet", str(dest))
    # A local fetch gives its upload-pack no `-c` setting: name it in the command.
    upload_pack = f"git {shlex.join(TRUSTED)} upload-pack"
    fetch = ("fetch", "--quiet", "--depth=1", "--no-tags", f"--upload-pack={upload_pack}")
    git(*fetch, "--end-of-options", task.repo, commit, cwd=dest)
    git("checkout", "--quiet", "--detach", "FETCH_HEAD", cwd=dest)
    (dest / ".git" / "info").mkdir(exist_ok=True)
    with (dest / ".git" / "info" / "exclude").open("a") as excludes:
        excludes.write(LOCAL_EXCLUDES)
    return git("rev-parse", "HEAD", cwd=dest).decode().strip()


def diff(copy: Path, base: str) -> bytes:
    """Everything the run changed against `base` (committed or not, new files included,
    ignored ones not), as a patch `git apply` takes: binary files in git's binary form, no
    colour, diff drivers or prefixes from any configuration."""
    git("add", "--all", cwd=copy)
    return git(
        *("diff", "--cached", "--binary", "--no-color", "--no-ext-diff", "--no-textconv"),
        *("--src-prefix=a/", "--dst-prefix=b/", base, "--"),
        cwd=copy,
    )


def agent_env(task: CodingTask, copy: Path) -> dict[str, str]:
    """What the agent's commands get on top of the harness's environment (mini's
    `environment.env`): the task's venv first on PATH, and a PYTHONPATH of the copy's
    directories only (never the harness's own)."""
    env = {"PYTHONPATH": os.pathsep.join(str(copy / p) for p in task.python_path)}
    if task.environment is not None:
        path = os.environ.get("PATH", os.defpath)
        env["PATH"] = f"{task.environment / 'bin'}{os.pathsep}{path}"
        env["VIRTUAL_ENV"] = str(task.environment)
    return env


def mini_argv(
    args: argparse.Namespace, task: CodingTask, copy: Path, trajectory: Path
) -> list[str]:
    """mini's command line: non-interactive (--yolo: no confirmations; --exit-immediately:
    no prompt for a new task), cost limit off (a served model has no price), its default
    config, then ours. Every -c value is JSON, which mini decodes, so any text survives."""
    settings = {
        "agent.step_limit": args.step_limit,
        "model.cost_tracking": "ignore_errors",
        "environment.cwd": str(copy),
        "environment.env": agent_env(task, copy),
    }
    argv = [str(args.mini), "--yolo", "--exit-immediately", "--cost-limit=0"]
    argv += [f"--model={args.model}", f"--config={args.mini_config}"]
    argv += [f"--config={key}={json.dumps(value)}" for key, value in settings.items()]
    argv += [f"--config={setting}" for setting in args.set]
    return [*argv, f"--output={trajectory}", f"--task={task.text()}"]


def run_mini(argv: Sequence[str], rundir: Path) -> int:
    """Run mini from the run's directory (so no config file of the task's repository is
    taken for one of mini's); its exit status (-N: killed by signal N)."""
    env = {**os.environ, **OFFLINE_ENV, "MSWEA_GLOBAL_CONFIG_DIR": str(rundir / "mini-swe-agent")}
    done = subprocess.run(argv, cwd=rundir, env=env, stdin=subprocess.DEVNULL, check=False)
    return done.returncode


def outcome(trajectory: Path) -> dict[str, Any]:
    """How mini says its run ended (exit_status, model_calls), from its trajectory."""
    try:
        info = json.loads(trajectory.read_text())["info"]
    except (OSError, ValueError, KeyError, TypeError):
        return {"exit_status": None, "model_calls": None}
    return {
        "exit_status": info.get("exit_status"),
        "model_calls": info.get("model_stats", {}).get("api_calls"),
    }


def report(result: dict[str, Any], patch: bytes, rundir: Path) -> None:
    """The result at $HARNESSRL_OUTPUT (else on stdout), the patch file beside it."""
    output = os.environ.get("HARNESSRL_OUTPUT")
    (Path(output).parent if output else rundir).joinpath(PATCH).write_bytes(patch)
    text = json.dumps(result)
    if output:
        Path(output).write_text(text)
    else:
        sys.stdout.write(f"{RESULT_PREFIX}{text}\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="openai/policy", help="litellm model name")
    parser.add_argument("--step-limit", type=int, default=30, help="most model calls")
    parser.add_argument("--mini", type=Path, default=MINI, help="the `mini` command")
    parser.add_argument("--mini-config", default="mini.yaml", help="mini's base config")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="more mini config"
    )
    parser.add_argument("--task-file", type=Path, help="the task input, else $HARNESSRL_TASK")
    return parser.parse_args(argv)


def read_task(task_file: Path | None) -> CodingTask:
    """The task from `task_file` or $HARNESSRL_TASK; raises TaskError."""
    if task_file is not None:
        raw = task_file.read_text()
    elif "HARNESSRL_TASK" in os.environ:
        raw = os.environ["HARNESSRL_TASK"]
    else:
        raise TaskError("input: no task (neither $HARNESSRL_TASK nor --task-file)")
    try:
        return CodingTask.from_input(json.loads(raw))
    except json.JSONDecodeError as err:
        raise TaskError(f"input: not JSON: {err}") from err


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rundir = Path.cwd()
    copy = rundir / COPY
    try:
        task = read_task(args.task_file)
        base = working_copy(task, copy)
    except TaskError as err:
        sys.stderr.write(f"launch.py: {err}\n")
        return EX_TASK
    except GitError as err:
        sys.stderr.write(f"launch.py: {err}\n")
        return EX_TEMPFAIL
    if not os.access(args.mini, os.X_OK):
        sys.stderr.write(f"launch.py: no {args.mini}: run `python {HERE / 'install.py'}`\n")
        return 1
    trajectory = rundir / TRAJECTORY
    argv = mini_argv(args, task, copy, trajectory)
    shown = [*argv[:-1], f"--task=<{len(task.text())} characters>"]
    sys.stderr.write(f"launch.py: base {base}, running {shlex.join(shown)}\n")
    code = run_mini(argv, rundir)
    patch = diff(copy, base)
    # Decoded for JSON; patch.diff keeps the exact bytes should a file not be UTF-8.
    result = {"patch": patch.decode("utf-8", "replace"), **outcome(trajectory)}
    report({**result, "base_commit": base}, patch, rundir)
    if code < 0:  # killed: end the same way, so the controller sees a crash
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    sys.exit(main())
