"""What every `harnessrl` subcommand shares, the services' own and the tools': its error
type, the --config and Kafka options, settings loaded from them, a service run, a task file
read, a progress line."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the CLI imports pydantic only when a command runs
    from harnessrl.config import ServiceConfig, ServiceSection
    from harnessrl.runtime import Runtime, Service
    from harnessrl.tasks import TaskLine

C = TypeVar("C", bound="ServiceConfig")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def read_tasks(path: Path, *, after_error: str = "") -> list[TaskLine]:
    """Every task of a task file (at least one), or CliError naming the file, the line and
    the field of the first bad one (`after_error` is appended to that message)."""
    from harnessrl.tasks import TaskFileError, parse_task_file

    try:
        tasks = parse_task_file(path)
    except TaskFileError as err:
        raise CliError(f"{err}{after_error}") from None
    except OSError as err:
        raise CliError(f"{path}: {err.strerror}") from None
    if not tasks:
        raise CliError(f"{path}: no tasks in file")
    return tasks


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="YAML config file (default: $HARNESSRL_CONFIG); environment variables win",
    )


def add_kafka_options(parser: argparse.ArgumentParser) -> None:
    add_config_option(parser)
    parser.add_argument(
        "--bootstrap",
        metavar="HOST:PORT",
        help="Kafka bootstrap servers (overrides kafka.bootstrap_servers)",
    )


def load(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """Load a config for a command, applying --bootstrap; bad values become a CliError."""
    from pydantic import ValidationError

    from harnessrl.config import load_config

    if getattr(args, "bootstrap", None):
        overrides["kafka"] = {**overrides.get("kafka", {}), "bootstrap_servers": args.bootstrap}
    try:
        return load_config(cls, getattr(args, "config", None), **overrides)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        raise CliError(f"invalid configuration: {problems}") from None
    except FileNotFoundError as err:
        raise CliError(str(err)) from None


def serve_service(
    name: str,
    config: ServiceConfig,
    section: ServiceSection,
    build: Callable[[Runtime], Service],
    **options: bool,
) -> int:
    """A service command's body: run the service process (harnessrl.runtime.serve, with its
    `options`) to its exit code; a setting the service refuses (ValueError while it is
    built) is a CliError."""
    from harnessrl.runtime import serve

    try:
        return serve(name, config, section, build, **options)
    except ValueError as err:
        raise CliError(str(err)) from None


def module_main(
    package: str, command: str, register: Callable[[Any], None], argv: list[str] | None
) -> int:
    """`python -m <package> [flags]`: the same as `harnessrl <command> [flags]`, whose
    parser `register` adds; `argv` defaults to the process's arguments."""
    parser = argparse.ArgumentParser(prog=f"python -m {package}")
    register(parser.add_subparsers())
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    code: int = args.run(args)
    return code


class Progress:
    """One progress line on stderr: redrawn in place on a terminal; elsewhere (logs, CI) a
    line at each 10% step, at most one a second, and always a final one."""

    def __init__(self, label: str, total: int | None, stream: IO[str] | None = None) -> None:
        self._label = label
        self._total = total
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._started = time.monotonic()
        self._last_draw = self._started
        self._last_step = 0
        self._done = 0
        self._note = ""

    def update(self, done: int, note: str = "") -> None:
        """Progress is `done` of the total; `note` (optional) follows the figures."""
        self._done = done
        self._note = note
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw >= 0.1:
                self._draw(now, "\r", "\x1b[K")
            return
        step = done * 10 // self._total if self._total else done // 1000
        if step != self._last_step and now - self._last_draw >= 1.0:
            self._last_step = step
            self._draw(now, "", "\n")

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw(time.monotonic(), "\r" if self._tty else "", "\n")

    def _draw(self, now: float, prefix: str, suffix: str = "") -> None:
        self._last_draw = now
        self._stream.write(prefix + self._line(now) + suffix)
        self._stream.flush()

    def _line(self, now: float) -> str:
        rate = self._done / max(now - self._started, 1e-9)
        per_s = f"({rate:,.0f}/s)" if rate >= 10 else f"({rate:.2f}/s)"
        note = f"  {self._note}" if self._note else ""
        if self._total:
            width = 30
            filled = min(width, width * self._done // self._total)
            bar = "#" * filled + "." * (width - filled)
            return f"{self._label} [{bar}] {self._done}/{self._total} {per_s}{note}"
        return f"{self._label} {self._done} {per_s}{note}"
