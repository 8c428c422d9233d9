"""The hidden cases' runner: calls a task's functions with given inputs and writes down, as
plain data, what each call returned or raised. With mode "record", runs the task's test
suite and writes down the inputs of the calls that reach the functions a fix changed.

Never imported by harnessrl. builtin:tests (`hidden_cases.py`) and `swe clean --validate`
run it as `python -I -c <this file's text>` in the test jail, in the task's environment and
repository copy. Its input is one JSON document on standard input, read whole before any
code of the repository runs; its output is JSON lines on the descriptor HARNESSRL_CASES_FD
names (the jail's channel, which the reader caps). The expected outputs are never in its
input: a patch that does not compute them cannot know what to write.

Mode "run": {"mode": "run", "import_root": ".", "cases": [{"id", "module", "function",
"args", "kwargs"}]}. For each case, in order: import the module, call the function, write
{"id", "r": the value returned} or {"id", "x": the exception's type}, with "a" and "k", the
arguments after the call (a call may change them); {"id", "e": type} when the function
could not be found. Then {"end": number of cases}. With "case_timeout_s" (making cases, on
the fixed code), a call still running after that long is cut: {"id", "t": true}.

Mode "record": {"mode": "record", "import_root", "targets": [[file, first line]],
"package": [directory or file, ...], "exclude": [file name patterns], "exclude_dirs":
[folder names: tests live there], "pytest": [args],
"per_function": n, "arg_bytes": n}. Runs pytest with a trace on calls: each call of a
module-level function of the package (its files, less the excluded) has its arguments
written down as it starts; when a call reaches a target function, the written-down calls
still running on its stack (the target's own among them) are recorded. Writes {"call":
{"module", "function", "args", "kwargs", "target"}} per distinct call (at most
`per_function` of each function), then {"end": pytest's exit status}. With "focus" (test
node ids), each call a test of the focus makes into such a function is recorded too (a fix
that changes no function: the failing tests' own ways in).

Values are tagged plain data, exact types only (a subclass is not its base, so an `int`
whose `__eq__` says yes to everything is written as what it is):

    null true false                 None, True, False
    {"i": "12"} {"f": "0.5"}        int (decimal), float (repr: "nan", "-0.0", "inf")
    {"c": "(1+2j)"}                 complex (repr)
    {"s": "text"} {"u": "hex"}      str (as text; "u": UTF-8 with lone surrogates, as hex)
    {"b": "hex"} {"ba": "hex"}      bytes, bytearray
    {"l": [...]} {"t": [...]}       list, tuple
    {"d": [[k, v], ...]}            dict, in its order
    {"set": [...]} {"fs": [...]}    set, frozenset: elements ordered by their JSON text
    {"o": "module.Type"}            anything else: its type only
    {"big": true}                   deeper than 32 or more than 20,000 values

Runs on the task's interpreter (Python 3.8 or later) with the standard library only.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
import os
import signal
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable

_TYPE, _ID, _LEN, _ISINSTANCE = type, id, len, isinstance  # bound before any package code
_DEPTH, _NODES = 32, 20000
_VARARGS, _VARKEYWORDS = 0x04, 0x08


class _TooBig(Exception):
    pass


def _name(cls: type) -> str:
    return "{}.{}".format(getattr(cls, "__module__", "?"), getattr(cls, "__qualname__", "?"))


def encode(value: Any) -> Any:
    """`value` as tagged plain data (see the module docstring)."""
    budget = [_NODES]
    try:
        return _encode(value, 0, budget)
    except _TooBig:
        return {"big": True}


def _encode(value: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if budget[0] < 0 or depth > _DEPTH:
        raise _TooBig()
    kind = _TYPE(value)
    if value is None or kind is bool:
        return value
    if kind is int:
        return {"i": int.__repr__(value)}
    if kind is float:
        return {"f": float.__repr__(value)}
    if kind is complex:
        return {"c": complex.__repr__(value)}
    if kind is str:
        try:
            str.encode(value, "utf-8")
        except UnicodeEncodeError:
            return {"u": str.encode(value, "utf-8", "surrogatepass").hex()}
        return {"s": value}
    if kind is bytes:
        return {"b": bytes.hex(value)}
    if kind is bytearray:
        return {"ba": bytes(value).hex()}
    if kind is list or kind is tuple:
        items = [_encode(item, depth + 1, budget) for item in value]
        return {"l" if kind is list else "t": items}
    if kind is dict:
        pairs = value.items()
        return {"d": [[_encode(k, depth + 1, budget), _encode(v, depth + 1, budget)]
                      for k, v in pairs]}  # fmt: skip
    if kind is set or kind is frozenset:
        items = [_encode(item, depth + 1, budget) for item in value]
        items.sort(key=lambda item: json.dumps(item, sort_keys=True))
        return {"set" if kind is set else "fs": items}
    return {"o": _name(kind)}


def replayable(data: Any) -> bool:
    """Whether tagged plain data describes a value `decode` can make again (no "o", no
    "big" anywhere in it)."""
    if _ISINSTANCE(data, list):
        return all(replayable(item) for item in data)
    if _ISINSTANCE(data, dict):
        return not ("o" in data or "big" in data) and all(
            replayable(item) for item in data.values()
        )
    return True


def decode(data: Any) -> Any:
    """The value tagged plain data describes (inputs only: never "o" or "big")."""
    if data is None or _ISINSTANCE(data, bool):
        return data
    if not _ISINSTANCE(data, dict) or _LEN(data) != 1:
        raise ValueError(f"not a tagged value: {data!r}")
    ((tag, raw),) = data.items()
    if tag == "i":
        return int(raw)
    if tag == "f":
        return float(raw)
    if tag == "c":
        return complex(raw)
    if tag == "s":
        return str(raw)
    if tag == "u":
        return bytes.fromhex(raw).decode("utf-8", "surrogatepass")
    if tag == "b":
        return bytes.fromhex(raw)
    if tag == "ba":
        return bytearray.fromhex(raw)
    if tag in ("l", "t", "set", "fs"):
        items = [decode(item) for item in raw]
        return {"l": list, "t": tuple, "set": set, "fs": frozenset}[tag](items)
    if tag == "d":
        return {decode(k): decode(v) for k, v in raw}
    raise ValueError(f"not an input value: {data!r}")


class _AnswerChannel:
    def __init__(self) -> None:
        self.fd = int(os.environ["HARNESSRL_CASES_FD"])
        self.write = os.write

    def send(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record) + "\n").encode("utf-8")
        while data:
            data = data[self.write(self.fd, data) :]


class _CaseTimeout(BaseException):
    pass


def _expired(signum: int, frame: Any) -> None:
    raise _CaseTimeout()


def run(config: dict[str, Any], channel: _AnswerChannel) -> None:
    limit = float(config.get("case_timeout_s") or 0)  # making cases: a call may loop forever
    if limit:
        signal.signal(signal.SIGALRM, _expired)
    for case in config["cases"]:
        out = {"id": case["id"]}
        try:
            args = [decode(a) for a in case["args"]]
            kwargs = {k: decode(v) for k, v in case["kwargs"]}
            function = getattr(importlib.import_module(case["module"]), case["function"])
        except BaseException as err:  # written down as the case's outcome
            out["e"] = _name(_TYPE(err))
            channel.send(out)
            continue
        try:
            if limit:
                signal.setitimer(signal.ITIMER_REAL, limit)
            out["r"] = encode(function(*args, **kwargs))
        except _CaseTimeout:
            out["t"] = True
        except BaseException as err:  # the call's outcome, whatever it is
            out["x"] = _name(_TYPE(err))
        finally:
            if limit:
                signal.setitimer(signal.ITIMER_REAL, 0)
        out["a"] = [encode(a) for a in args]
        out["k"] = [[k, encode(v)] for k, v in kwargs.items()]
        channel.send(out)
    channel.send({"end": _LEN(config["cases"])})


class _Recorder:
    """The trace of mode "record" (see the module docstring)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.targets = {(os.path.abspath(f), line) for f, line in config["targets"]}
        self.package = [os.path.abspath(p).rstrip(os.sep) for p in config["package"]]
        self.exclude = list(config["exclude"])
        self.exclude_dirs = set(config.get("exclude_dirs", ()))
        self.per_function = int(config["per_function"])
        self.arg_bytes = int(config["arg_bytes"])
        self.known: dict[str, bool] = {}  # file name -> whether it is package code
        self.running: dict[int, Any] = {}  # id(frame) -> (frame, written-down call or None)
        self.seen: dict[Any, Any] = {}  # (module, function) -> set of argument texts
        self.calls: list[dict[str, Any]] = []
        self.focus = set(config.get("focus", ()))
        self.focused = False  # a test of `focus` is running

    def is_package(self, filename: str) -> bool:
        known = self.known.get(filename)
        if known is None:
            path = os.path.abspath(filename)
            inside = filename.endswith(".py") and os.path.isfile(path)  # not "<frozen ...>"
            inside = inside and any(path == p or path.startswith(p + os.sep) for p in self.package)
            base = os.path.basename(path)
            known = inside and not any(fnmatch.fnmatch(base, x) for x in self.exclude)
            known = known and not self.exclude_dirs.intersection(path.split(os.sep)[:-1])
            self.known[filename] = known
        return known

    def trace(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event != "call":
            return None
        code = frame.f_code
        if not self.is_package(code.co_filename):
            return None
        target = (os.path.abspath(code.co_filename), code.co_firstlineno) in self.targets
        entry = None
        if getattr(frame.f_globals.get(code.co_name), "__code__", None) is code:
            entry = self.written_down(frame, code)
        if entry is not None and self.focused and not self.is_package(_caller_file(frame)):
            self.keep(entry, False)  # a call the failing test itself makes
        if entry is None and not target:
            return None
        frame.f_trace_lines = False
        self.running[_ID(frame)] = (frame, entry)
        if target:
            self.reached(frame)
        return self.local

    def local(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        if event == "return":
            self.running.pop(_ID(frame), None)
        return self.local

    def written_down(self, frame: FrameType, code: CodeType) -> dict[str, Any] | None:
        names, values = code.co_varnames, frame.f_locals
        count, kwonly = code.co_argcount, code.co_kwonlyargcount
        try:
            args = [encode(values[n]) for n in names[:count]]
            kwargs = [[n, encode(values[n])] for n in names[count : count + kwonly]]
            at = count + kwonly
            if code.co_flags & _VARARGS:
                args += [encode(v) for v in values[names[at]]]
                at += 1
            if code.co_flags & _VARKEYWORDS:
                kwargs += [[k, encode(v)] for k, v in values[names[at]].items()]
        except Exception:  # a frame whose arguments cannot be read
            return None
        text = json.dumps([args, kwargs], sort_keys=True)
        if _LEN(text) > self.arg_bytes or not replayable([args, kwargs]):
            return None  # only plain inputs can be replayed
        module = frame.f_globals.get("__name__")
        if not _ISINSTANCE(module, str) or module == "__main__":
            return None
        return {"module": module, "function": code.co_name, "args": args, "kwargs": kwargs,
                "text": text}  # fmt: skip

    def reached(self, frame: FrameType) -> None:
        at: FrameType | None = frame
        depth = 0
        while at is not None:
            running = self.running.get(_ID(at))
            if running is not None and running[0] is at and running[1] is not None:
                self.keep(running[1], depth == 0)
            at, depth = at.f_back, depth + 1

    def keep(self, entry: dict[str, Any], target: bool) -> None:
        seen = self.seen.setdefault((entry["module"], entry["function"]), set())
        if entry["text"] in seen or _LEN(seen) >= self.per_function:
            return
        seen.add(entry["text"])
        call = {k: entry[k] for k in ("module", "function", "args", "kwargs")}
        self.calls.append(dict(call, target=target))


def _caller_file(frame: FrameType) -> str:
    return frame.f_back.f_code.co_filename if frame.f_back is not None else ""


class _Focus:
    """A pytest plugin: tells the recorder while a test of its focus runs."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def pytest_runtest_setup(self, item: Any) -> None:
        recorder = self.recorder
        recorder.focused = (
            item.nodeid in recorder.focus or item.nodeid.split("[")[0] in recorder.focus
        )

    def pytest_runtest_teardown(self, item: Any) -> None:
        self.recorder.focused = False


def record(config: dict[str, Any], channel: _AnswerChannel) -> None:
    import pytest

    recorder = _Recorder(config)
    threading.settrace(recorder.trace)
    sys.settrace(recorder.trace)
    try:
        status = pytest.main(list(config["pytest"]), plugins=[_Focus(recorder)])
    finally:
        sys.settrace(None)
        threading.settrace(None)
    for call in recorder.calls:
        channel.send({"call": call})
    channel.send({"end": int(status)})


def main() -> None:
    config = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # nothing of the input is left for package code to read
    channel = _AnswerChannel()
    sys.path.insert(0, os.path.abspath(config["import_root"]))
    (record if config["mode"] == "record" else run)(config, channel)


if __name__ == "__main__":
    main()
