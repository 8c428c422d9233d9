"""A harness that tries what a policy's commands might: write and delete outside its copy,
read the controller's files, reach the broker and the internet, fork without end; and asks
the gateway for its models, as a real harness would.

The task ($HARNESSRL_TASK) names the targets; the result ($HARNESSRL_OUTPUT) reports each
attempt as "ok" or the error it met, so the test can tell what the sandbox stopped. Run by
tests/integration/test_harness_sandbox.py; standard library only (it runs on whatever
Python the sandbox shows).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from typing import Any


def attempt(action: Callable[[], object]) -> str:
    try:
        action()
    except OSError as err:
        return f"{errno.errorcode.get(err.errno or 0, 'error')}: {err.strerror}"
    return "ok"


def write(path: str) -> None:
    with open(path, "w") as f:
        f.write("planted by the harness")


def read(path: str) -> None:
    with open(path, "rb") as f:
        f.read()


def connect(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=3):
        pass


def connect_abstract(name: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect("\0" + name)


def write_bytes(path: str, size: int) -> None:
    with open(path, "wb") as f:
        f.write(b"x" * size)


def cmdline(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def gateway_models() -> dict[str, Any]:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/models",
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return {"status": response.status, "body": json.loads(response.read())}


def fork_bomb(attempts: int) -> dict[str, Any]:
    """Fork until refused, every child forking once more and then waiting; bounded by
    `attempts` so that a machine without the sandbox's limit is not brought down."""
    forked, refused = 0, None
    for _ in range(attempts):
        try:
            pid = os.fork()
        except OSError as err:
            refused = errno.errorcode.get(err.errno or 0, str(err.errno))
            break
        if pid == 0:
            with contextlib.suppress(OSError):
                os.fork()
            time.sleep(120)
            os._exit(0)
        forked += 1
    seen = sum(name.isdigit() for name in os.listdir("/proc"))
    return {"forked": forked, "refused": refused, "processes_seen": seen}


def main() -> None:
    task = json.loads(os.environ["HARNESSRL_TASK"])
    report: dict[str, Any] = {
        "uid": os.getuid(),
        "pid": os.getpid(),
        "writes": {p: attempt(lambda p=p: write(p)) for p in task["write"]},
        "deletes": {p: attempt(lambda p=p: os.remove(p)) for p in task["delete"]},
        "reads": {p: attempt(lambda p=p: read(p)) for p in task["read"]},
        "listings": {p: sorted(os.listdir(p)) if os.path.isdir(p) else None for p in task["list"]},
        "connects": {
            f"{h}:{p}": attempt(lambda h=h, p=p: connect(h, p)) for h, p in task["connect"]
        },
        "abstract": attempt(lambda: connect_abstract(task["abstract"])),
        "own_write": attempt(lambda: write("own.txt")),
        "big_file": attempt(lambda: write_bytes("big.bin", task["big_file_bytes"])),
        "processes": [cmdline(p) for p in os.listdir("/proc") if p.isdigit()],
    }
    try:
        report["gateway"] = gateway_models()
    except OSError as err:
        report["gateway"] = {"error": repr(err)}
    report["fork_bomb"] = fork_bomb(task["fork_attempts"])
    with open(os.environ["HARNESSRL_OUTPUT"], "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
    sys.exit(0)
