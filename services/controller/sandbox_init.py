"""The first process of a sandboxed harness run: pid 1 of its PID namespace, and its relay
to the gateway. Runs inside the sandbox as a plain script (`python -I -S init.py CONFIG`),
so it imports nothing but the standard library.

It binds the relay's listeners (127.0.0.1 and ::1 on the gateway's port) while it may still
bind any port, drops to the run's uid when the controller runs as root (all capabilities go
with it), makes the run's HOME, then forks the harness: a new session, default signal
dispositions, no descriptor but stdio, the run's resource limits, its directory, exec. Then
it serves, in one thread, until the harness exits:

- connections to the listeners, each carried byte for byte to the unix socket that the
  controller relays to the gateway (at most `max_connections` at once);
- SIGTERM (the controller's polite stop, sent to this process's group): passed on to every
  process of the sandbox; SIGKILL needs no help (pid 1 dies, and the namespace with it);
- the control socket: its end means the controller is gone, and so is the run (it exits at
  once; --die-with-parent alone would not do, since changing uid disarms it);
- SIGCHLD: it reaps every process that ends (orphans are re-parented to it).

When the harness exits it reports `exit <code>` (negative: killed by that signal) and exits,
and the kernel kills whatever else is left in the namespace. Before that it reports
`started`, or `failed <reason>` when it could not set up or exec the harness.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import socket
import sys
from typing import Any

_CHUNK = 64 * 1024
_RESET = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM)


class _Link:
    """One relayed connection: the harness's TCP socket and the gateway's unix socket."""

    def __init__(self, relay: _GatewayListener, tcp: socket.socket, unix: socket.socket) -> None:
        self.relay = relay
        self.peer = {tcp: unix, unix: tcp}
        self.pending = {tcp: b"", unix: b""}
        """Bytes waiting to be written to each socket."""
        self.ended: set[socket.socket] = set()
        """Sockets that sent their end of stream."""
        for sock in (tcp, unix):
            sock.setblocking(False)
            relay.selector.register(sock, selectors.EVENT_READ, self)

    def ready(self, sock: socket.socket, events: int) -> None:
        try:
            if events & selectors.EVENT_READ:
                data = sock.recv(_CHUNK)
                peer = self.peer[sock]
                if data:
                    self.pending[peer] += data
                else:
                    self.ended.add(sock)
                    if not self.pending[peer]:
                        peer.shutdown(socket.SHUT_WR)
            if events & selectors.EVENT_WRITE:
                sent = sock.send(self.pending[sock])
                self.pending[sock] = self.pending[sock][sent:]
                if not self.pending[sock] and self.peer[sock] in self.ended:
                    sock.shutdown(socket.SHUT_WR)
        except BlockingIOError:
            pass  # not ready after all: the selector says when it is
        except OSError:
            self.close()
            return
        if len(self.ended) == 2 and not any(self.pending.values()):
            self.close()
        else:
            self.listen()

    def listen(self) -> None:
        """Read from a socket only when its peer has nothing pending (back-pressure)."""
        for sock, peer in self.peer.items():
            events = 0
            if sock not in self.ended and not self.pending[peer]:
                events |= selectors.EVENT_READ
            if self.pending[sock]:
                events |= selectors.EVENT_WRITE
            selector = self.relay.selector
            registered = sock in selector.get_map()
            if events and registered:
                selector.modify(sock, events, self)
            elif events:
                selector.register(sock, events, self)
            elif registered:
                selector.unregister(sock)

    def close(self) -> None:
        for sock in self.peer:
            with contextlib.suppress(KeyError, ValueError):
                self.relay.selector.unregister(sock)
            sock.close()
        self.relay.links.discard(self)


class _GatewayListener:
    """The loop of pid 1: relayed connections, the control socket, child exits."""

    def __init__(self, config: dict[str, Any], control: socket.socket) -> None:
        self.config = config
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.links: set[_Link] = set()
        self.listeners = [_listen(host, config["port"]) for host in ("127.0.0.1", "::1")]
        if self.listeners[0] is None:
            raise OSError(f"cannot listen on 127.0.0.1:{config['port']}")

    def serve(self, harness: int, wake: int) -> int:
        """Until the harness exits; its exit code (negative: its signal)."""
        for listener in self.listeners:
            if listener is not None:
                listener.setblocking(False)
                self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        self.selector.register(wake, selectors.EVENT_READ, "child")
        while True:
            for key, events in self.selector.select():
                if key.data == "accept":
                    self._accept(key.fileobj)  # type: ignore[arg-type]
                elif key.data == "control":
                    self._command()
                elif key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        os.read(wake, 4096)
                    code = _reap(harness)
                    if code is not None:
                        return code
                else:
                    key.data.ready(key.fileobj, events)

    def _accept(self, listener: socket.socket) -> None:
        try:
            tcp, _ = listener.accept()
        except OSError:
            return
        if len(self.links) >= self.config["max_connections"]:
            tcp.close()
            return
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            unix.settimeout(5)
            unix.connect(self.config["socket"])
        except OSError:
            tcp.close()
            unix.close()
            return
        link = _Link(self, tcp, unix)
        self.links.add(link)

    def _command(self) -> None:
        try:
            data = self.control.recv(4096)
        except OSError:
            data = b""
        if not data:  # the controller is gone: so is the run (the kernel kills the rest)
            os._exit(128 + signal.SIGKILL)


def _pass_on(signum: int, frame: object) -> None:
    with contextlib.suppress(OSError):
        os.kill(-1, signum)  # every process of the sandbox but pid 1


def _listen(host: str, port: int) -> socket.socket | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as err:
        sock.close()
        if family == socket.AF_INET:
            raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from err
        return None  # no IPv6 loopback in this kernel: 127.0.0.1 alone
    return sock


def _reap(harness: int) -> int | None:
    """Reap every ended child; the harness's exit code once it is among them."""
    code = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return code
        if pid == 0:
            return code
        if pid == harness:
            code = os.waitstatus_to_exitcode(status)


def _drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def _make_home(home: str, uid: int | None) -> None:
    os.makedirs(home, mode=0o700, exist_ok=True)
    if uid is not None:
        os.chown(home, uid, uid)


def _limit(resource_id: int, value: int) -> None:
    """Soft and hard limit `value`, or the hard limit already there if that is lower (only
    a privileged process may raise it)."""
    _, hard = resource.getrlimit(resource_id)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(resource_id, (value, value))


def _start_harness(config: dict[str, Any]) -> int:
    """Fork and exec the harness; its pid. Raises OSError when the exec failed."""
    failures_r, failures_w = os.pipe()  # close-on-exec: EOF means the exec succeeded
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            os.setsid()
            for sig in _RESET:
                signal.signal(sig, signal.SIG_DFL)
            os.closerange(3, failures_w)
            os.closerange(failures_w + 1, os.sysconf("SC_OPEN_MAX"))
            for name, value in config["limits"].items():
                _limit(getattr(resource, f"RLIMIT_{name}"), value)
            os.chdir(config["cwd"])
            os.execvp(config["argv"][0], config["argv"])
        except BaseException as err:
            os.write(failures_w, f"{config['argv'][0]!r}: {err}".encode())
        finally:
            os._exit(127)
    os.close(failures_w)
    with os.fdopen(failures_r, "rb") as failures:
        failure = failures.read().decode("utf-8", "replace")
    if failure:
        os.waitpid(pid, 0)
        raise OSError(failure)
    return pid


def main(argv: list[str]) -> None:
    config = json.loads(argv[1])
    control = socket.socket(fileno=config["control_fd"])
    try:
        relay = _GatewayListener(config, control)
        _make_home(config["home"], config["uid"])
        if config["uid"] is not None:
            _drop_privileges(config["uid"])
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, _pass_on)
        harness = _start_harness(config)
    except Exception as err:
        control.sendall(f"failed {err}\n".encode())
        os._exit(1)
    control.sendall(b"started\n")
    code = relay.serve(harness, wake_r)
    with contextlib.suppress(OSError):
        control.sendall(f"exit {code}\n".encode())
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main(sys.argv)
