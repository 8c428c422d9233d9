"""Candidate bugs for synthesized coding tasks: single-point AST mutations of Python source.

The SWE-smith procedure without an LLM: each mutation changes one thing a programmer gets
wrong (a comparison's boundary, a boolean operator, an off-by-one constant, two arguments
swapped, a statement or a return value left out, the wrong arithmetic operator) and keeps
every other byte of the file, so the task's gold patch (the reverse of the mutation) is a
one- or two-line diff and nothing else in the file gives the change away. Whether a
candidate is a task is decided by running the project's tests (synth keeps those that
break between one and a bound of tests that passed).

    for mutation in mutations("pkg/core.py", source):
        mutation.source   # the whole mutated file; it compiles and differs from `source`

Positions come from the AST (lines, UTF-8 byte columns); the edit is made on the original
text: an operator's token in the gap between its operands, a constant's literal, two
arguments' texts, a statement's lines. Annotations, docstrings and `if __name__ ==
"__main__":` blocks are never mutated. Pure and deterministic: the same source gives the
same mutations in the same order.
"""

from __future__ import annotations

import ast
import hashlib
import io
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass

_COMPARE: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BINARY: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Mod: ast.FloorDiv,
    ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
"""Each swap stays within one precedence level, so the edited text parses the same way."""
_BOOL: dict[type[ast.boolop], type[ast.boolop]] = {ast.And: ast.Or, ast.Or: ast.And}
_SYMBOL: dict[type[ast.AST], str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.And: "and",
    ast.Or: "or",
}
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")
Splices = tuple[tuple[int, int, str], ...]
"""An edit of a source: (start, end, replacement) str offsets, not overlapping."""
KINDS = ("compare", "boolean", "constant", "operator", "arguments", "statement", "return")


@dataclass(frozen=True, slots=True)
class Mutation:
    """One candidate bug: `source` is the whole mutated file."""

    path: str
    kind: str
    """One of KINDS."""
    line: int
    """1-based line of the change in the original file."""
    description: str
    """What changed, for reports (never shown to the agent: it would give the fix away)."""
    source: str


def mutations(path: str, source: str) -> Iterator[Mutation]:
    """Every single-point mutation of `source` (a Python module), in source order. Raises
    SyntaxError when `source` does not parse."""
    tree = ast.parse(source)
    text = _Text(source)
    skip = _untouchable(tree)
    # (line, col, kind, description, splices): the edits, not the mutated sources, are held
    # (a big module has thousands of candidates), each source made only when it is yielded
    edits: list[tuple[int, int, str, str, Splices]] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        for kind, description, splices in _edits(node, text):
            edits.append((node.lineno, node.col_offset, kind, description, splices))  # type: ignore[attr-defined]
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and len(block) >= 2:
                for stmt, description, cut in _removed_statements(block, text):
                    if id(stmt) not in skip:
                        edits.append((stmt.lineno, stmt.col_offset, "statement", description, cut))
    seen: set[bytes] = set()
    for line, _, kind, description, change in sorted(edits, key=lambda e: e[:4]):
        new = text.apply(change)
        digest = hashlib.blake2b(new.encode(), digest_size=16).digest()
        if new == source or digest in seen or not _compiles(new, path):
            continue
        seen.add(digest)
        yield Mutation(path, kind, line, description, new)


class _Text:
    """The source with AST positions (line, UTF-8 byte column) turned into str offsets."""

    def __init__(self, source: str) -> None:
        self.source = source
        # Python's own line ends only (str.splitlines also splits at \f, \x1c, \u2028, ...)
        self._lines = _LINE.findall(source)
        self._starts = [0]
        for line in self._lines:
            self._starts.append(self._starts[-1] + len(line))

    def offset(self, line: int, col: int) -> int:
        raw = self._lines[line - 1].encode()[:col] if line <= len(self._lines) else b""
        return self._starts[line - 1] + len(raw.decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]
        end = self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]
        return start, end

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.source[start:end]

    def replace(self, start: int, end: int, new: str) -> Splices:
        return ((start, end, new),)

    def apply(self, splices: Splices) -> str:
        """The source with each (start, end, new) of `splices` (not overlapping) applied."""
        out, at = [], 0
        for start, end, new in sorted(splices):
            out += [self.source[at:start], new]
            at = end
        out.append(self.source[at:])
        return "".join(out)


def _untouchable(tree: ast.Module) -> set[int]:
    """Ids of the nodes no mutation may touch: annotations, docstrings, `__main__` blocks."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            roots += [a.annotation for a in _arguments(node.args) if a.annotation]
            if node.returns:
                roots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        elif isinstance(node, ast.If) and _is_main_guard(node.test):
            roots.append(node)
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            roots.append(body[0])
    return {id(n) for root in roots for n in ast.walk(root)}


def _arguments(args: ast.arguments) -> list[ast.arg]:
    extra = [a for a in (args.vararg, args.kwarg) if a is not None]
    return [*args.posonlyargs, *args.args, *args.kwonlyargs, *extra]


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and len(test.comparators) == 1
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "__main__"
    )


def _edits(node: ast.AST, text: _Text) -> Iterator[tuple[str, str, Splices]]:
    """(kind, description, splices) for each mutation rooted at `node`."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            new = _COMPARE.get(type(op))
            if new is not None:
                yield from _swap_operator(
                    text, operands[i], operands[i + 1], op, new, kind="compare"
                )
    elif isinstance(node, ast.BoolOp):
        new_bool = _BOOL[type(node.op)]
        for left, right in zip(node.values, node.values[1:], strict=False):
            yield from _swap_operator(text, left, right, node.op, new_bool, kind="boolean")
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        new_op = _BINARY[type(node.op)]
        yield from _swap_operator(text, node.left, node.right, node.op, new_op, kind="operator")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        start, end = text.span(node)
        operand = text.segment(node.operand)
        if isinstance(node.operand, ast.BoolOp | ast.IfExp | ast.Lambda | ast.NamedExpr):
            operand = f"({operand})"
        yield "boolean", "`not` dropped", text.replace(start, end, operand)
    elif isinstance(node, ast.Constant):
        yield from _constant(node, text)
    elif isinstance(node, ast.Call):
        yield from _swapped_arguments(node, text)
    if isinstance(node, ast.Return) and node.value is not None:
        start, _ = text.span(node)
        _, end = text.span(node.value)
        if not (isinstance(node.value, ast.Constant) and node.value.value is None):
            yield "return", "returns None instead of its value", text.replace(start, end, "return")


def _swap_operator(
    text: _Text,
    left: ast.AST,
    right: ast.AST,
    old: ast.AST,
    new: type[ast.AST],
    *,
    kind: str,
) -> Iterator[tuple[str, str, Splices]]:
    """The operator token between `left` and `right` replaced, the rest kept."""
    _, gap_start = text.span(left)
    gap_end, _ = text.span(right)
    gap = text.source[gap_start:gap_end]
    found = _token_in(gap, _SYMBOL[type(old)])
    if found is None:
        return
    start, end = found
    before, after = _SYMBOL[type(old)], _SYMBOL[new]
    mutated = text.replace(gap_start + start, gap_start + end, after)
    yield kind, f"`{before}` -> `{after}`", mutated


def _token_in(gap: str, symbol: str) -> tuple[int, int] | None:
    """[start, end) of the operator `symbol` (one or two tokens) in `gap`, outside
    parentheses and comments; None when it is not there exactly once."""
    words = symbol.split()
    tokens: list[tokenize.TokenInfo] = []
    reader = tokenize.generate_tokens(io.StringIO(gap).readline)
    while True:  # a gap such as ") < (" is a fragment: keep the tokens read before it fails
        try:
            tokens.append(next(reader))
        except (StopIteration, tokenize.TokenError, SyntaxError):
            break
    lines = [0]
    for line in _LINE.findall(gap):
        lines.append(lines[-1] + len(line))

    def at(row: int, col: int) -> int:
        return lines[row - 1] + col

    names = [t for t in tokens if t.type in (tokenize.OP, tokenize.NAME) and t.string not in "()"]
    hits = []
    for i in range(len(names) - len(words) + 1):
        if [t.string for t in names[i : i + len(words)]] == words:
            hits.append((at(*names[i].start), at(*names[i + len(words) - 1].end)))
    return hits[0] if len(hits) == 1 else None


def _constant(node: ast.Constant, text: _Text) -> Iterator[tuple[str, str, Splices]]:
    start, end = text.span(node)
    value = node.value
    if isinstance(value, bool):
        yield "boolean", f"`{value}` -> `{not value}`", text.replace(start, end, str(not value))
    elif isinstance(value, int) and text.segment(node).isdigit():  # a plain literal
        for new in (value + 1, value - 1):
            if new >= 0:
                yield "constant", f"`{value}` -> `{new}`", text.replace(start, end, str(new))


def _swapped_arguments(node: ast.Call, text: _Text) -> Iterator[tuple[str, str, Splices]]:
    args = node.args
    if len(args) < 2 or any(isinstance(a, ast.Starred) for a in args[:2]):
        return
    first, second = text.segment(args[0]), text.segment(args[1])
    if first == second:
        return
    (a0, a1), (b0, b1) = text.span(args[0]), text.span(args[1])
    mutated = ((a0, a1, second), (b0, b1, first))
    yield "arguments", f"arguments `{first}` and `{second}` swapped", mutated


def _removed_statements(
    body: list[ast.stmt], text: _Text
) -> Iterator[tuple[ast.stmt, str, Splices]]:
    """Each simple statement of a block, deleted with its whole lines (only when it has its
    lines to itself)."""
    for stmt in body:
        if not isinstance(stmt, ast.Expr | ast.Assign | ast.AugAssign | ast.AnnAssign):
            continue
        if _is_docstring(stmt) or (isinstance(stmt, ast.AnnAssign) and stmt.value is None):
            continue
        start, end = text.span(stmt)
        line_start = text.source.rfind("\n", 0, start) + 1
        line_end = text.source.find("\n", end)
        line_end = len(text.source) if line_end < 0 else line_end + 1
        if text.source[line_start:start].strip() or text.source[end:line_end].strip():
            continue  # shares a line with other code (`a = 1; b = 2`)
        first = text.segment(stmt).splitlines()[0]
        yield stmt, f"`{first}` removed", text.replace(line_start, line_end, "")


def _compiles(source: str, path: str) -> bool:
    try:
        compile(source, path, "exec", dont_inherit=True)
    except (SyntaxError, ValueError):
        return False
    return True
