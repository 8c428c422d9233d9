"""Records where a Python process goes on the network, for tests of harnesses run unmodified.

A directory on PYTHONPATH is searched for `sitecustomize` when any interpreter starts, so
naming this one there reaches every Python process of a harness (and the processes it
starts with that environment) without changing a line of it. With $NET_AUDIT_LOG set, each
name lookup (`socket.getaddrinfo`) and each connect to a network address (`socket.connect`)
appends one JSON line `{"pid", "event", "host", "port"}` to that file. Writing at start-up
is the purpose of this module (it has no other use).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

_EVENTS = ("socket.getaddrinfo", "socket.connect")


def _install(path: str) -> None:
    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event not in _EVENTS:
            return
        where = args[0:2] if event == "socket.getaddrinfo" else args[1]
        if not isinstance(where, tuple) or len(where) < 2:
            return  # a Unix socket: no network
        host, port = where[0], where[1]
        line = {"pid": os.getpid(), "event": event, "host": str(host), "port": port}
        # One write(2) per line on an O_APPEND file: lines of processes never interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(line, default=str) + "\n").encode())
        finally:
            os.close(fd)

    sys.addaudithook(hook)


if os.environ.get("NET_AUDIT_LOG"):
    _install(os.environ["NET_AUDIT_LOG"])
