"""A harness that goes after what pays it and what it must not hold: the shared secrets (in
every process's environment it can see, in every file it can read under the places secrets
live), the broker (a TCP connection, as a Kafka producer of a forged reward would open), the
gateway's admin API (closing its own episode without the admin token); and makes one call
through the gateway, as a real harness would.

The task ($HARNESSRL_TASK) gives the targets and, for the secrets, only their SHA-256
digests: the harness never learns a secret it did not find. The result ($HARNESSRL_OUTPUT)
reports what it found and what it reached. Standard library only. Run by
tests/integration/test_compose_containment.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import socket
import urllib.error
import urllib.request
from typing import Any

_TOKEN = re.compile(rb"[A-Za-z0-9_\-./+=]{32,}")


def found_in(data: bytes, digests: set[str]) -> bool:
    """Whether `data` holds a secret whose digest is in `digests` (as a whole value, as a
    line, or as a token-like run of characters)."""
    pieces = {data, data.strip(), *data.split(b"\0"), *data.splitlines()}
    for piece in list(pieces):
        _, _, value = piece.partition(b"=")
        pieces.add(value)
    pieces.update(_TOKEN.findall(data))
    return any(hashlib.sha256(p).hexdigest() in digests for p in pieces)


def scan_processes(digests: set[str]) -> dict[str, Any]:
    """Every /proc/PID/environ and cmdline it can read: which hold a secret."""
    readable, holding = 0, []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    data = f.read()
            except OSError:
                continue
            readable += 1
            if found_in(data, digests):
                holding.append(f"{pid}/{name}")
    return {"readable": readable, "holding_a_secret": holding}


_INSTALLED = frozenset({".venv", "node_modules", "site-packages", "__pycache__", ".git"})
"""Folders of installed code, never where a deployment keeps a secret: a checkout under one
of the roots (a clone in /tmp) would otherwise have the scan read all of torch."""


def scan_files(roots: list[str], digests: set[str]) -> dict[str, Any]:
    """Every file it can read under `roots`, installed code aside: which hold a secret."""
    holding, seen = [], 0
    for root in roots:
        for top, folders, files in os.walk(root):
            folders[:] = [f for f in folders if f not in _INSTALLED]
            for name in files:
                path = os.path.join(top, name)
                try:
                    with open(path, "rb") as f:
                        data = f.read(1 << 20)
                except OSError:
                    continue
                seen += 1
                if found_in(data, digests):
                    holding.append(path)
    return {"read": seen, "holding_a_secret": holding}


def read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.read()
    except OSError as err:
        return errno.errorcode.get(err.errno or 0, "error")
    return "ok"


def connect(host: str, port: int) -> str:
    try:
        with socket.create_connection((host, port), timeout=3):
            pass
    except OSError as err:
        return errno.errorcode.get(err.errno or 0, "error") if err.errno else str(err)
    return "ok"


def http(url: str, *, method: str = "GET", token: str = "", body: bytes | None = None) -> Any:
    request = urllib.request.Request(url, data=body, method=method)
    if token:
        request.add_header("authorization", f"Bearer {token}")
    request.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError as err:
        return str(err)


def main() -> None:
    task = json.loads(os.environ["HARNESSRL_TASK"])
    digests = set(task["secret_digests"])
    base = os.environ["OPENAI_BASE_URL"]  # <gateway>/e/<token>/v1
    gateway = base.split("/e/", 1)[0]
    report = {
        "uid": os.getuid(),
        "own_environment": found_in(
            b"\0".join(f"{k}={v}".encode() for k, v in os.environ.items()), digests
        ),
        "processes": scan_processes(digests),
        "files": scan_files(task["secret_roots"], digests),
        "reads": {path: read(path) for path in task["read"]},
        "broker": {f"{h}:{p}": connect(h, p) for h, p in task["broker"]},
        "gateway_models": http(f"{base}/models", token=os.environ.get("OPENAI_API_KEY", "")),
        "admin_close_without_token": http(
            f"{gateway}/admin/episodes/{task['episode']}/close",
            method="POST",
            body=b'{"attempt": 1}',
        ),
        "admin_close_with_the_episode_token": http(
            f"{gateway}/admin/episodes/{task['episode']}/close",
            method="POST",
            token=os.environ.get("OPENAI_API_KEY", ""),
            body=b'{"attempt": 1}',
        ),
    }
    with open(os.environ["HARNESSRL_OUTPUT"], "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
