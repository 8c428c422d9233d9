"""The stack file: what a running `harnessrl up` tells the tools that drive it.

`<workdir>/stack.json` is written once every service is ready and removed when the stack
stops, and again when the next `up` starts in that work directory (a killed `up` leaves
one). Beside the broker, each service and the traces file, it holds the gateway's URLs and
the secrets `up` generated (the episode-token secret, the admin token), so it is created
readable by its owner only (mode 0600). `harnessrl experiment --stack` and
`harnessrl episode` read it; `harnessrl episode` records the episodes it opened beside it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_WORKDIR = Path(".harnessrl")
"""`harnessrl up --workdir`'s default (relative to where it runs)."""
STACK_FILE = "stack.json"
MANUAL_EPISODES_FILE = "manual-episodes.jsonl"
"""Episodes `harnessrl episode open` opened on this stack, beside the stack file."""
PRIVATE = 0o600


class StackFileError(ValueError):
    """The file is not a stack file this version can use; the message says why."""


@dataclass(frozen=True, slots=True)
class GatewayAccess:
    """What it takes to open and close episodes at a stack's gateway by hand."""

    url: str
    """Harness-facing base URL (OpenAI at `<url>/e/<token>/v1`, Anthropic at `<url>/e/<token>`)."""
    admin_url: str
    """Base URL of the admin API (the same as `url` unless `gateway.admin_port` is set)."""
    token_secret: str = field(repr=False)
    """HMAC secret the gateway verifies episode tokens with."""
    admin_token: str = field(repr=False)
    """Bearer token of the admin API."""

    def as_json(self) -> dict[str, str]:
        return {
            "url": self.url,
            "admin_url": self.admin_url,
            "token_secret": self.token_secret,
            "admin_token": self.admin_token,
        }


def write_stack_file(path: Path, data: dict[str, Any], gateway: GatewayAccess) -> None:
    """Write `data` and the gateway's access as the stack file at `path`, atomically and
    with mode 0600 from the moment it exists."""
    write_private(path, json.dumps({**data, "gateway": gateway.as_json()}, indent=2) + "\n")


def read_gateway_access(path: Path) -> GatewayAccess:
    """The gateway's access from the stack file at `path`. Raises FileNotFoundError when
    there is none, StackFileError when it is not one this version wrote."""
    text = path.read_text()
    try:
        gateway = json.loads(text)["gateway"]
        return GatewayAccess(
            url=str(gateway["url"]),
            admin_url=str(gateway["admin_url"]),
            token_secret=str(gateway["token_secret"]),
            admin_token=str(gateway["admin_token"]),
        )
    except (ValueError, KeyError, TypeError) as err:
        raise StackFileError(
            f"{path}: not a stack file with the gateway's access (missing {err}); "
            "restart `harnessrl up` with this version"
        ) from err


def remove_stack_files(workdir: Path) -> None:
    """Remove the stack file and the manual-episode record of `workdir` (idempotent)."""
    for name in (STACK_FILE, MANUAL_EPISODES_FILE):
        (workdir / name).unlink(missing_ok=True)


def write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, atomically (a temporary file beside it, renamed over it)
    and mode 0600 whatever the umask: the temporary file is created with that mode, so the
    content is never readable by anyone else, not even for a moment."""
    partial = path.with_name(path.name + ".tmp")
    partial.unlink(missing_ok=True)  # left by a killed writer; O_EXCL needs it gone
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), PRIVATE)  # the umask may have taken the owner's bits
            out.write(text)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
