"""What a sandboxed run sees: its mounts, the bwrap command line, its environment.

Pure apart from reading the file system to find what a harness command needs. The mounts
are applied in order of depth (a path before anything under it), so a mask (an empty tmpfs
over the controller's state, its other runs, HOME) hides what a read-only path above it
would show, and whatever is named below the mask (the run's own directory, a Python
installation in HOME) is mounted over it again.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from harnessrl.bubblewrap import Mount, is_system, system_mounts, under, venv_base, with_parents

HOSTNAME = "harnessrl"
SUPPORT = Path("/run/harnessrl")
"""Where the sandbox finds its init script and the gateway relay's socket."""
INIT = SUPPORT / "init.py"
GATEWAY_SOCKET = SUPPORT / "gateway.sock"
HOME = "/tmp/home"
"""HOME inside the sandbox (the controller's is never visible)."""


def python_paths() -> list[Path]:
    """The controller's Python installations (its venv and the interpreter under it); the
    sandbox's init runs on that interpreter."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return [Path(p) for p in sorted(prefixes) if not is_system(Path(p))]


def command_paths(command: Iterable[str], search_path: str | None, home: Path | None) -> list[Path]:
    """What a harness command needs to run: its program's installation, for the program as
    named and as its symlinks resolve (a venv, with its base interpreter; else the parent of
    its bin/ directory, unless that is / or HOME or right under either, where only the
    program is: ~/.local or ~/.cargo hold more than programs), and every argument that is
    an absolute path to a file (a script, a config file)."""
    argv = list(command)
    found: list[Path] = []
    program = shutil.which(argv[0], path=search_path) if argv else None
    anchors = {Path("/"), *([home] if home is not None else [])}
    if program is not None:
        for path in (Path(os.path.abspath(program)), Path(os.path.realpath(program))):
            prefix = path.parent.parent if path.parent.name == "bin" else path
            venv = venv_base(prefix)
            if not venv and (prefix in anchors or prefix.parent in anchors):
                prefix = path
            found += [prefix, *venv]
    found += [Path(arg) for arg in argv[1:] if os.path.isabs(arg) and os.path.isfile(arg)]
    return [path for path in found if not is_system(path)]


def file_mounts(
    *,
    run_dir: Path,
    read_only: Iterable[Path],
    hidden: Iterable[Path],
    masked: Iterable[Path],
    support: Mapping[str, Path],
    tmp_bytes: int,
) -> tuple[list[Mount], list[Path]]:
    """The sandbox's mounts in the order bwrap applies them, and the read-only paths left
    out because they lie in a hidden directory.

    `read_only`: what the harness may read besides the system directories; `hidden`: what it
    must never see (the controller's state and work directories, the relay's directory):
    masked where a read-only path would show it, and nothing inside mounted; `masked`: what
    it sees only the named parts of (HOME: a Python installation in it stays visible);
    `support`: files bound read-only at fixed places (destination -> source); `run_dir`:
    the one writable directory, at its own path.
    """
    hidden = [p for p in hidden if p.exists()]
    kept: list[Path] = []
    refused: list[Path] = []
    for path in dict.fromkeys(read_only):
        real = Path(os.path.realpath(path))
        (refused if any(under(real, h) for h in hidden) else kept).append(path)
    masks = [p for p in (*hidden, *masked) if p.exists() and any(under(p, k) for k in kept)]
    mounts = [
        *system_mounts(),
        *(Mount("ro-bind", str(p), str(p)) for p in kept),
        Mount("tmpfs", "/tmp", size=tmp_bytes, perms="1777"),
        Mount("tmpfs", "/run", size=1024 * 1024),
        Mount("proc", "/proc"),
        Mount("dev", "/dev"),
        Mount("tmpfs", "/dev/shm", size=tmp_bytes, perms="1777"),
        *(Mount("tmpfs", str(p), size=1024 * 1024) for p in dict.fromkeys(masks)),
        Mount("bind", str(run_dir), str(run_dir)),
        *(Mount("ro-bind", dest, str(source)) for dest, source in support.items()),
    ]
    return [*with_parents(mounts), Mount("remount-ro", "/run")], refused


def bwrap_argv(
    bwrap: str,
    mounts: Iterable[Mount],
    *,
    privileged: bool,
    cwd: Path,
    info_fd: int,
    command: list[str],
) -> list[str]:
    """The bwrap command line. Privileged (the controller is root): no user namespace, the
    init drops to the run's uid itself; else a user namespace the harness cannot nest.
    bwrap writes the init's host pid to `info_fd`."""
    argv = [bwrap, "--die-with-parent", "--new-session", "--as-pid-1"]
    argv += ["--info-fd", str(info_fd)]
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net"]
    argv += ["--unshare-cgroup-try", "--hostname", HOSTNAME]
    if not privileged:
        argv += ["--unshare-user", "--disable-userns"]
    for mount in mounts:
        argv += mount.args()
    return [*argv, "--remount-ro", "/", "--chdir", str(cwd), "--", *command]


@dataclass(frozen=True, slots=True)
class GatewayAddress:
    """The gateway as the controller reaches it, and as the sandbox names it."""

    scheme: str
    host: str
    port: int
    inside_host: str
    """An IP literal becomes 127.0.0.1; a name stays (the sandbox's /etc/hosts maps it to
    127.0.0.1, so TLS still verifies)."""

    @classmethod
    def parse(cls, gateway_url: str) -> GatewayAddress:
        parts = urlsplit(gateway_url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            ipaddress.ip_address(host)
            inside = "127.0.0.1"
        except ValueError:
            inside = host
        return cls(parts.scheme, host, port, inside)

    def hosts_file(self) -> str:
        names = " ".join(dict.fromkeys(["localhost", HOSTNAME, self.inside_host]))
        return f"127.0.0.1 {names}\n::1 {names}\n"


def sandbox_env(env: Mapping[str, str], gateway_url: str) -> dict[str, str]:
    """The run's environment inside the sandbox: every value that starts with the gateway's
    origin (its base URLs) points at the in-sandbox relay instead; HOME and TMPDIR are the
    sandbox's own."""
    address = GatewayAddress.parse(gateway_url)
    parts = urlsplit(gateway_url)
    origin = f"{parts.scheme}://{parts.netloc}"
    inside = f"{address.scheme}://{_netloc(address.inside_host)}:{address.port}"
    out: dict[str, str] = {}
    for key, value in env.items():
        rest = value[len(origin) :]
        pointed = value.startswith(origin) and (not rest or rest[0] in "/?#")
        out[key] = inside + rest if pointed else value
    return out | {"HOME": HOME, "TMPDIR": "/tmp"}


def _netloc(host: str) -> str:
    return f"[{host}]" if ":" in host else host
