"""The real coding-agent CLIs that `make harness-clis` installs under tests/harnesses.

Both npm packages are thin launchers: the program itself is a native binary in an optional
platform package (`@openai/codex-linux-x64`, `@anthropic-ai/claude-code-linux-x64`, ...),
and npm installs only the one that matches this machine. The launchers' install scripts are
skipped (`npm ci --ignore-scripts`), so the binaries are found in those platform packages.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HARNESSES = Path(__file__).resolve().parent
REPO = HARNESSES.parents[1]
NODE_MODULES = HARNESSES / "node_modules"

# Relative to NODE_MODULES; `*` is the platform (and for Codex its target triple too).
CODEX_GLOB = "@openai/codex-*/vendor/*/bin/codex"
CLAUDE_GLOB = "@anthropic-ai/claude-code-*/claude"


class CliMissingError(RuntimeError):
    """A CLI is not installed, or could not be installed."""


def install(timeout_s: float) -> None:
    """Run `make harness-clis` (a no-op when the stamp is newer than the lock file).

    Raises CliMissingError naming the cause when make or npm is missing, when npm fails
    (the registry unreachable, an integrity mismatch), or when it takes over `timeout_s`.
    """
    for tool in ("make", "npm"):
        if shutil.which(tool) is None:
            raise CliMissingError(f"`{tool}` is not on PATH; it is needed to install the CLIs")
    try:
        done = subprocess.run(
            ["make", "--no-print-directory", "harness-clis"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise CliMissingError(
            f"`make harness-clis` took over {timeout_s:.0f}s: is the npm registry reachable "
            f"(npm config get registry)? Output so far:\n{_text(err.stdout)}{_text(err.stderr)}"
        ) from err
    if done.returncode != 0:
        raise CliMissingError(
            f"`make harness-clis` failed (exit {done.returncode}); is the npm registry "
            f"reachable? Output:\n{done.stdout}{done.stderr}"
        )


def codex_binary() -> Path:
    """The Codex CLI's native binary; raises CliMissingError when it is not installed."""
    return _one(CODEX_GLOB)


def claude_binary() -> Path:
    """The Claude Code CLI's native binary; raises CliMissingError when it is not installed."""
    return _one(CLAUDE_GLOB)


def _one(pattern: str) -> Path:
    found = sorted(NODE_MODULES.glob(pattern))
    if len(found) != 1:
        raise CliMissingError(
            f"expected one {NODE_MODULES}/{pattern}, found {[str(p) for p in found]}; "
            "run `make harness-clis`"
        )
    return found[0]


def _text(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
