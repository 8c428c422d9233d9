"""The test guard: a pytest plugin that reports a jailed test run to builtin:tests.

Never imported by harnessrl. The test jail (`jail.py`) mounts this file into the task's
Python environment as the top-level module `harnessrl_testguard`, and the run loads it with
`-p harnessrl_testguard` in PYTEST_ADDOPTS: before the repository's conftests, before any
test module, so before any code of the patch can run. It then:

- takes its key (32 bytes) from a pipe it closes at once (keeping only an HMAC state made
  from it: the key is in no environment variable, no file, no attribute), and moves its
  channel (a pipe to the reward) to a random descriptor that child processes do not get;
- snapshots the runner: every function and class of pytest, _pytest, pluggy and unittest
  (identity, code object, class attributes);
- reports, as frames the reward authenticates (HMAC-SHA256 under the key, numbered from 0):
  `hello` (and which files of the repository were imported before it), `collected` (the
  node ids, and collection errors), `call` (what the test's call raised, seen by its own
  innermost wrapper around the call, not through pytest's reports), `test` (pytest's report
  of each phase), `tamper` (what the checks found), `end` (the exit status), then closes
  the channel;
- checks, after collection, before each test's call and at the end, that the runner is the
  one it snapshotted (pytest's own configure-time patches aside); that no hook
  implementation, trace or profile function or builtin hook comes from the repository's
  package code (test files, conftests and the task's plugin modules may hold them), nor
  the loader of a test module; that the item about to run has no instance attribute shadowing
  one of its class's methods; that the test function is the one collected, compiled
  from its test file as that file is on disk (or, behind a decorator, that the file's own
  code ran to its end during the call).

Runs on the task's interpreter (Python 3.8 or later, pytest 7 or later) with the standard
library (and pytest) only. It sees what the process sees: code of the patch running in this
process can still defeat it by driving or rewriting it in memory; the reward's cross-checks
of the frames, the exit status and the collected set are what such code must then also get
right.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import hmac
import json
import os
import resource
import secrets
import struct
import sys
import types
from typing import Any

import pytest

_MISSING = object()
_RUNNER_TOPS = ("pytest", "_pytest", "pluggy", "unittest", "py")
_SENSITIVE_BUILTINS = ("__import__", "__build_class__", "compile", "exec", "eval")
_TEXT_LIMIT = 2000
_MUTABLE = {
    # pytest sets these module globals itself while it runs (assertion rewriting's hooks).
    ("_pytest.assertion.util", "_reprcompare"),
    ("_pytest.assertion.util", "_assertion_pass"),
    ("_pytest.assertion.util", "_config"),
    ("_pytest.assertion.rewrite", "_reprcompare"),
}


def _take_env(name: str) -> str | None:
    value = os.environ.pop(name, None)
    return value if value else None


class _Channel:
    """Numbered frames, each `len(u32) | hmac(32) | payload`, on the reward's pipe. The key
    itself is not kept: only an HMAC state holding it (copied for each frame)."""

    def __init__(self, fd: int, key: bytes) -> None:
        self._fd: int | None = fd
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self._n = 0
        self._write = os.write
        self._dumps = json.dumps
        self._pack = struct.pack

    def send(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        record = dict(record, n=self._n)
        self._n += 1
        payload = self._dumps(record, sort_keys=True, default=str).encode("utf-8")
        mac = self._mac.copy()
        mac.update(payload)
        data = memoryview(self._pack(">I", len(payload)) + mac.digest() + payload)
        while data:
            written = self._write(self._fd, data)
            data = data[written:]

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _open_channel() -> _Channel | None:
    """The reward's channel, or None where there is none (a nested pytest run: its parent's
    descriptors are not inherited). The key is read from its pipe, which is then closed;
    the channel moves to a random descriptor number, not inherited by child processes."""
    fd_text = _take_env("HARNESSRL_GUARD_FD")
    key_fd_text = _take_env("HARNESSRL_GUARD_KEY_FD")
    if fd_text is None or key_fd_text is None:
        return None
    try:
        fd, key_fd = int(fd_text), int(key_fd_text)
        key = b""
        while len(key) < 32:
            chunk = os.read(key_fd, 32 - len(key))
            if not chunk:
                break
            key += chunk
        os.close(key_fd)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        top = max(64, min(soft, 4096) - 1)
        moved = fcntl.fcntl(fd, fcntl.F_DUPFD, secrets.randbelow(top - 32) + 32)
        os.set_inheritable(moved, False)
        os.close(fd)
    except (OSError, ValueError):
        return None
    return _Channel(moved, key) if len(key) == 32 else None


def _function_of(value: Any) -> Any:
    """The function behind a method, property, staticmethod or classmethod."""
    if isinstance(value, property):
        value = value.fget
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, types.MethodType):
        value = value.__func__
    return value


def _code_of(value: Any) -> types.CodeType | None:
    return getattr(_function_of(value), "__code__", None)


def _suspicious(value: Any) -> bool:
    """Whether a value in a class or module can change behaviour: code, or a descriptor."""
    return callable(value) or hasattr(type(value), "__get__")


class _Snapshot:
    """The runner's functions and classes: what the checks hold it to."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, str, Any, Any, types.CodeType | None, str]] = []
        """(namespace, name, value, the function behind it, its code, where)"""
        self.classes: list[tuple[Any, frozenset[str], str]] = []
        self.take()

    def take(self) -> None:
        self.entries, self.classes = [], []
        for modname, module in sorted(sys.modules.items()):
            if module is None or modname.partition(".")[0] not in _RUNNER_TOPS:
                continue
            space = getattr(module, "__dict__", None)
            if space is None:
                continue
            for name, value in list(space.items()):
                if (modname, name) in _MUTABLE or not _suspicious(value):
                    continue
                self._add(space, name, value, modname + "." + name)
                if isinstance(value, type) and getattr(value, "__module__", "") == modname:
                    self._add_class(value, modname + "." + name)

    def _add(self, space: Any, name: str, value: Any, where: str) -> None:
        function = _function_of(value)
        code = getattr(function, "__code__", None)
        self.entries.append((space, name, value, function, code, where))

    def _add_class(self, cls: type, where: str) -> None:
        space = cls.__dict__
        self.classes.append((space, frozenset(space), where))
        for name, value in list(space.items()):
            if _suspicious(value):
                self._add(space, name, value, where + "." + name)

    def changed(self, allowed: Any = None) -> list[str]:
        """What differs from the snapshot; `allowed(value)` excuses a new value. (Run
        before every test: identity comparisons only, unless something differs.)"""
        found = []
        for space, name, value, function, code, where in self.entries:
            if space.get(name, _MISSING) is value and (code is None or function.__code__ is code):
                continue
            now = space.get(name, _MISSING)
            if allowed is None or not allowed(now):
                found.append("runner changed: " + where)
        for space, keys, where in self.classes:
            if space.keys() == keys:
                continue
            for name in set(space) - keys:
                value = space[name]
                if _suspicious(value) and (allowed is None or not allowed(value)):
                    found.append("runner class attribute added: " + where + "." + name)
        return found


def _runner_origin(value: Any) -> bool:
    """Whether `value` is code of pytest or pluggy themselves (pytest's own plugins patch
    a few of its classes while it configures)."""
    function = _function_of(value)
    code = _code_of(function)
    name = getattr(function, "__module__", None) or ""
    origin = getattr(sys.modules.get(name), "__file__", None)
    if code is None or origin is None or name.partition(".")[0] not in ("_pytest", "pytest"):
        return False
    return _real(code.co_filename) == _real(origin)


class _Repository:
    """The repository under test, as the reward describes it."""

    def __init__(self, root: str, tests: tuple[str, ...], plugins: frozenset[str]) -> None:
        self.root = root
        self.tests = tests
        self.plugins = plugins

    def package_code(self, code: types.CodeType | None) -> bool:
        """Whether `code` is the repository's package code (not a test file, a conftest or
        a plugin module the task's configuration loads)."""
        if code is None:
            return False
        return self.package_file(code.co_filename)

    def package_file(self, filename: str) -> bool:
        path = _real(filename)
        return _inside(path, self.root) and not self.test_side(path)

    def test_side(self, path: str) -> bool:
        """Test code, as builtin:tests' patch rules define it (they refuse a patch that
        changes any of it): a conftest.py, a plugin module of the task's configuration, a
        protected path or a path the command names, test_*.py and *_test.py, anything
        under a test/ or tests/ directory of the repository."""
        name = os.path.basename(path)
        if name == "conftest.py" or path in self.plugins:
            return True
        if any(_inside(path, p) for p in self.tests):
            return True
        if fnmatch.fnmatchcase(name, "test_*.py") or fnmatch.fnmatchcase(name, "*_test.py"):
            return True
        parts = os.path.relpath(path, self.root).split(os.sep)[:-1]
        return any(part in ("test", "tests") for part in parts)


class _Guard:
    """The plugin object, registered with the first pytest configuration only."""

    def __init__(
        self, config: Any, channel: _Channel, snapshot: _Snapshot, repo: _Repository
    ) -> None:
        self.config = config
        self.channel = channel
        self.snapshot = snapshot
        self.repo = repo
        self.collected: dict[str, tuple[Any, types.CodeType | None]] = {}
        self.defs: dict[str, dict[tuple[str, int], list[types.CodeType]]] = {}
        self.seen: set[str] = set()
        self.ended = False

    # -- reporting -----------------------------------------------------------------------

    def tamper(self, found: list[str]) -> None:
        fresh = [f for f in found if f not in self.seen]
        if fresh:
            self.seen.update(fresh)
            self.channel.send({"k": "tamper", "found": fresh[:50]})

    def check(self, where: str, item: Any = None) -> list[types.CodeType]:
        """Run the checks; the code to watch while `item` runs (see `_item`)."""
        watch: list[types.CodeType] = []
        try:
            found = self.snapshot.changed() + self._slots()
            if item is not None:
                problems, watch = self._item(item)
                found += problems
        except Exception as err:
            found = ["guard check failed at " + where + ": " + type(err).__name__]
        self.tamper(found)
        return watch

    # -- hooks ---------------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_collectreport(self, report: Any) -> None:
        if report.outcome != "passed":
            self.channel.send({"k": "collect", "nodeid": report.nodeid, "outcome": report.outcome})

    @pytest.hookimpl(trylast=True)
    def pytest_collection_finish(self, session: Any) -> None:
        for item in session.items:
            function = getattr(item, "obj", None) if _is_function(item) else None
            self.collected[item.nodeid] = (function, _code_of(function))
        self.channel.send({"k": "collected", "nodeids": [i.nodeid for i in session.items]})
        self.check("collection")

    @pytest.hookimpl(hookwrapper=True, trylast=True)
    def pytest_runtest_call(self, item: Any) -> Any:
        watch = self.check("call", item)
        tracer, previous = None, None
        if watch:  # a wrapped test: its own code must run to its end, at least once
            tracer, previous = self._watched(watch), sys.gettrace()
            sys.settrace(tracer)
        try:
            outcome = yield
        finally:
            if tracer is not None:
                sys.settrace(previous)
        excinfo = outcome.excinfo
        raised = None if excinfo is None else _exception_name(excinfo[0])
        if tracer is not None and raised is None and tracer.completed[0] == 0:
            self.tamper(["the test's own code did not run to its end: " + item.nodeid])
        self.channel.send({"k": "call", "nodeid": item.nodeid, "raised": raised})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: Any) -> None:
        longrepr = ""
        if report.outcome != "passed":
            try:
                longrepr = str(report.longreprtext)[-_TEXT_LIMIT:]
            except Exception:
                longrepr = ""
        self.channel.send(
            {
                "k": "test",
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "xfail": bool(getattr(report, "wasxfail", None) is not None),
                # a subtest's report (unittest's subTest, pytest's subtests fixture): one of
                # many of the same phase
                "sub": "subtest" in type(report).__name__.lower() or hasattr(report, "context"),
                "text": longrepr,
            }
        )

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> None:
        if self.ended:
            return
        self.check("end")
        self.ended = True
        self.channel.send({"k": "end", "exitstatus": int(exitstatus)})
        self.channel.close()

    # -- checks --------------------------------------------------------------------------

    def _slots(self) -> list[str]:
        found = []
        hooks = self.config.pluginmanager.hook
        for name in dir(hooks):
            caller = getattr(hooks, name, None)
            get_impls = getattr(caller, "get_hookimpls", None)
            if get_impls is None:
                continue
            for impl in get_impls():
                if self.repo.package_code(_code_of(impl.function)):
                    found.append("hook implementation in package code: " + name)
        for name in ("gettrace", "getprofile"):
            function = getattr(sys, name)()
            if self.repo.package_code(_code_of(function)):
                found.append("a " + name[3:] + " function from package code")
        builtins = sys.modules["builtins"]
        for name in _SENSITIVE_BUILTINS:
            if self.repo.package_code(_code_of(getattr(builtins, name, None))):
                found.append("builtins." + name + " replaced by package code")
        return found

    def _item(self, item: Any) -> tuple[list[str], list[types.CodeType]]:
        """What is wrong with the item about to run, and the code of its test function as
        its file has it, which must run to its end during the call when pytest calls it
        through a wrapper ([] when pytest calls that code itself)."""
        found = []
        for name, value in list(vars(item).items()):
            if callable(value) and callable(getattr(type(item), name, None)):
                found.append("test item method replaced: " + name)
        if item.nodeid not in self.collected:
            return [*found, "a test that was not collected runs: " + item.nodeid], []
        module = getattr(item, "module", None)
        spec = getattr(module, "__spec__", None)
        loader = getattr(spec, "loader", None) or getattr(module, "__loader__", None)
        executes = getattr(type(loader), "exec_module", None)
        if executes is not None and self.repo.package_code(_code_of(executes)):
            found.append("test module loaded by package code: " + item.nodeid)
        function, code = self.collected[item.nodeid]
        if function is None:
            return found, []
        now = getattr(item, "obj", None)
        if now is not function or _code_of(now) is not code:
            return [*found, "test function replaced after collection: " + item.nodeid], []
        problems, watch = self._as_written(item.nodeid, function)
        return found + problems, watch

    def _as_written(self, nodeid: str, function: Any) -> tuple[list[str], list[types.CodeType]]:
        """The function pytest calls is compiled from a test file as it is on disk
        (read-only in the jail), with or without pytest's assertion rewriting; or it wraps
        such a function (a decorator: mock.patch, hypothesis's given), whose code is then
        to be watched (returned) as the call runs."""
        outer = _code_of(function)
        if self.repo.package_code(outer):
            return ["test function from package code: " + nodeid], []
        inner = function
        for _ in range(20):
            wrapped = getattr(inner, "__wrapped__", None)
            if wrapped is None:
                break
            inner = wrapped
        code = _code_of(inner)
        if code is None:
            return [], []
        path = _real(code.co_filename)
        if not (_inside(path, self.repo.root) and self.repo.test_side(path)):
            return ["test function not defined in a test file: " + nodeid], []
        written = self._compiled(path).get((code.co_name, code.co_firstlineno), [])
        if not written:
            return ["test function is not the code of its file: " + nodeid], []
        if inner is function and any(code == candidate for candidate in written):
            return [], []  # pytest calls the file's own code
        return [], written

    def _watched(self, watch: list[types.CodeType]) -> Any:
        """A trace function that counts, in its `completed`, the runs of `watch`'s code
        that end by returning (not by an exception leaving the frame)."""
        name = watch[0].co_name
        completed = [0]
        last: dict[int, str] = {}  # frame -> its last event

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "return" and last.pop(id(frame), "") != "exception":
                completed[0] += 1
            elif event != "return":
                last[id(frame)] = event
            return local

        def calls(frame: Any, event: str, arg: Any) -> Any:
            if event == "call" and frame.f_code.co_name == name and frame.f_code in watch:
                return local
            return None

        calls.completed = completed  # type: ignore[attr-defined]
        return calls

    def _compiled(self, path: str) -> dict[tuple[str, int], list[types.CodeType]]:
        """(name, first line) -> the code objects a test file compiles to, as pytest's
        assertion rewriting makes them and as plain Python does."""
        if path not in self.defs:
            found: dict[tuple[str, int], list[types.CodeType]] = {}
            for module in self._module_codes(path):
                stack = [module]
                while stack:
                    code = stack.pop()
                    found.setdefault((code.co_name, code.co_firstlineno), []).append(code)
                    stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
            self.defs[path] = found
        return self.defs[path]

    def _module_codes(self, path: str) -> list[types.CodeType]:
        codes = []
        try:
            with open(path, "rb") as handle:
                source = handle.read()
            codes.append(compile(source, path, "exec", dont_inherit=True))
            rewrite = sys.modules.get("_pytest.assertion.rewrite")
            rewritten = getattr(rewrite, "_rewrite_test", None)
            if rewritten is not None:
                codes.append(rewritten(__import__("pathlib").Path(path), self.config)[-1])
        except Exception:
            pass
        return codes


def _is_function(item: Any) -> bool:
    return type(item).__name__ in ("Function", "TestCaseFunction")


def _exception_name(kind: Any) -> str:
    try:
        return str(kind.__module__) + "." + str(kind.__qualname__)
    except AttributeError:
        return "unknown"


_REAL: dict[str, str] = {}


def _real(path: str) -> str:
    """os.path.realpath, remembered (the checks ask for the same few files again and again)."""
    found = _REAL.get(path)
    if found is None:
        found = _REAL[path] = os.path.realpath(path)
    return found


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _paths(name: str, root: str) -> tuple[str, ...]:
    value = _take_env(name) or ""
    return tuple(os.path.realpath(os.path.join(root, p)) for p in value.split("\n") if p)


def _preloaded(root: str) -> list[str]:
    """Files of the repository already imported: none, unless the task's own configuration
    loads a plugin module that imports them."""
    found = []
    for module in list(sys.modules.values()):
        origin = getattr(module, "__file__", None)
        if origin and _inside(os.path.realpath(origin), root):
            found.append(os.path.relpath(os.path.realpath(origin), root))
    return sorted(found)


_CHANNEL = _open_channel()
_ROOT = os.path.realpath(_take_env("HARNESSRL_GUARD_ROOT") or os.getcwd())
_TESTS = _paths("HARNESSRL_GUARD_TESTS", _ROOT)
_PLUGINS = frozenset(_paths("HARNESSRL_GUARD_PLUGINS", _ROOT))
_SNAPSHOT = _Snapshot() if _CHANNEL is not None else None
if _CHANNEL is not None:
    _CHANNEL.send(
        {
            "k": "hello",
            "pid": os.getpid(),
            "python": sys.version.split()[0],
            "preloaded": _preloaded(_ROOT),
            "runner_entries": len(_SNAPSHOT.entries) if _SNAPSHOT else 0,
        }
    )
_STATE = {"armed": False}


@pytest.hookimpl(trylast=True)
def pytest_configure(config: Any) -> None:
    """Arm the guard for the first configuration only (a nested in-process run, such as
    pytester's, gets nothing). pytest's own plugins have patched a few of its classes by
    now: those changes are accepted (their code is pytest's), any other is tampering, and
    the snapshot is taken again for the checks that follow."""
    if _CHANNEL is None or _SNAPSHOT is None or _STATE["armed"]:
        return
    _STATE["armed"] = True
    guard = _Guard(config, _CHANNEL, _SNAPSHOT, _Repository(_ROOT, _TESTS, _PLUGINS))
    guard.tamper(_SNAPSHOT.changed(allowed=_runner_origin))
    _SNAPSHOT.take()
    config.pluginmanager.register(guard, "harnessrl-testguard")
