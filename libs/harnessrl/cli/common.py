"""Options and helpers shared by the sub-commands."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # the CLI imports pydantic only when a command runs
    from harnessrl.config import ServiceConfig

C = TypeVar("C", bound="ServiceConfig")


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


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


class Progress:
    """One progress line on stderr: redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, label: str, total: int | None, stream: IO[str] | None = None) -> None:
        self._label = label
        self._total = total
        self._stream = stream or sys.stderr
        self._tty = self._stream.isatty()
        self._started = time.monotonic()
        self._last_draw = 0.0
        self._last_decile = -1

    def update(self, done: int) -> None:
        now = time.monotonic()
        if self._tty:
            if now - self._last_draw < 0.1 and done != self._total:
                return
            self._last_draw = now
            self._stream.write("\r" + self._line(done, now))
            self._stream.flush()
            return
        decile = done * 10 // self._total if self._total else done // 1000
        if decile != self._last_decile:
            self._last_decile = decile
            self._stream.write(self._line(done, now) + "\n")
            self._stream.flush()

    def close(self, done: int) -> None:
        self.update(done)
        if self._tty:
            self._stream.write("\n")

    def _line(self, done: int, now: float) -> str:
        rate = done / max(now - self._started, 1e-9)
        if self._total:
            width = 30
            filled = width * done // self._total
            bar = "#" * filled + "." * (width - filled)
            return f"{self._label} [{bar}] {done}/{self._total} ({rate:,.0f}/s)"
        return f"{self._label} {done} ({rate:,.0f}/s)"
