"""Install mini-swe-agent into its own virtual environment, from the hash-locked closure.

    python examples/swe/install.py              # examples/swe/.venv; a no-op when up to date
    python examples/swe/install.py --venv DIR   # somewhere else

The harness lives in a venv of its own, apart from the project's: it pulls litellm and
~80 other packages (~750 MB) that training never imports, and it must run as released.
Every package comes from `requirements.txt` (generated from `requirements.in`, see the
README), installed with `--require-hashes --no-deps`, so nothing outside the lock can enter.
A stamp in the venv records the lock's sha256; the venv is reinstalled when the lock changes.
Concurrent runs wait for each other (a lock file in the venv).

Standard library only, so any Python 3.11+ can run it; it exits 1 with pip's output when
the install fails (the package index unreachable, a hash mismatch).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "requirements.txt"
VENV = HERE / ".venv"
STAMP = ".harnessrl-lock-sha256"
"""In the venv: the sha256 of the lock it was installed from."""
TIMEOUT_S = 1200.0
"""Longest the pip install may take (~75 s here with an empty pip cache)."""


class InstallError(RuntimeError):
    """The venv could not be made or the lock not installed into it."""


def mini_executable(venv_dir: Path) -> Path:
    """The `mini` command of a venv made by `install`."""
    return venv_dir / "bin" / "mini"


def install(venv_dir: Path = VENV, timeout_s: float = TIMEOUT_S) -> Path:
    """Make `venv_dir` hold exactly the lock's packages (idempotent); its `mini` command.

    Raises InstallError naming the cause."""
    wanted = hashlib.sha256(LOCK.read_bytes()).hexdigest()
    venv_dir.mkdir(parents=True, exist_ok=True)
    with (venv_dir / ".install.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        stamp = venv_dir / STAMP
        if stamp.is_file() and stamp.read_text() == wanted:
            return mini_executable(venv_dir)
        stamp.unlink(missing_ok=True)
        # No `clear`: it would delete the lock file others wait on. pip installs over
        # whatever a failed earlier run left.
        venv.EnvBuilder(with_pip=True).create(venv_dir)
        python = venv_dir / "bin" / "python"
        argv = [
            *(str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"),
            *("--require-hashes", "--no-deps", "-r", str(LOCK)),
        ]
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as err:
            raise InstallError(f"pip install took over {timeout_s:.0f} s") from err
        if done.returncode != 0:
            raise InstallError(
                f"pip install -r {LOCK} failed (exit {done.returncode}); is the package "
                f"index reachable?\n{(done.stdout + done.stderr)[-4000:]}"
            )
        mini = mini_executable(venv_dir)
        if not mini.is_file():
            raise InstallError(f"the lock was installed but {mini} is missing")
        stamp.write_text(wanted)
        return mini


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=VENV, help=f"default {VENV}")
    args = parser.parse_args()
    try:
        mini = install(args.venv.absolute())
    except InstallError as err:
        sys.exit(f"install.py: {err}")
    sys.stdout.write(f"{mini}\n")


if __name__ == "__main__":
    main()
