"""Arithmetic word problems for the calculator demo, with fixed train and val splits.

A task is two operands and an operation (+, -, *, /), asked in one of several phrasings.
Which split a task belongs to is a pure function of its operands and operation, so a val
problem never appears among the train tasks (nor in the base model's pretraining data, which
draws from the train split only), whatever the seed or the number of tasks drawn.

    python examples/calculator/tasks.py --split train --n 400 --seed 1 > train.jsonl
    python examples/calculator/tasks.py --split val --n 100 > val.jsonl

Each line is a harnessrl task: the harness sees `input.question`; the expected answer is in
`metadata.answer`, which only the reward reads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from dataclasses import dataclass
from typing import Any, Literal

Split = Literal["train", "val"]

OPERATIONS = ("+", "-", "*", "/")
_NAMES = {"+": "add", "-": "sub", "*": "mul", "/": "div"}
_PHRASES = {
    "+": ("What is {a} plus {b}?", "What is {a} + {b}?", "Compute {a} + {b}.", "Add {a} and {b}."),
    "-": (
        "What is {a} minus {b}?",
        "What is {a} - {b}?",
        "Compute {a} - {b}.",
        "Subtract {b} from {a}.",
    ),
    "*": (
        "What is {a} times {b}?",
        "What is {a} * {b}?",
        "Compute {a} * {b}.",
        "Multiply {a} by {b}.",
    ),
    "/": (
        "What is {a} divided by {b}?",
        "What is {a} / {b}?",
        "Compute {a} / {b}.",
        "Divide {a} by {b}.",
    ),
}
VAL_FRACTION = 0.25
"""Share of all problems that belong to the val split."""


@dataclass(frozen=True, slots=True)
class Problem:
    a: int
    op: str
    b: int
    phrase: int

    @property
    def expression(self) -> str:
        return f"{self.a} {self.op} {self.b}"

    @property
    def answer(self) -> int:
        if self.op == "+":
            return self.a + self.b
        if self.op == "-":
            return self.a - self.b
        if self.op == "*":
            return self.a * self.b
        return self.a // self.b

    @property
    def question(self) -> str:
        return _PHRASES[self.op][self.phrase].format(a=self.a, b=self.b)

    @property
    def task_id(self) -> str:
        return f"{_NAMES[self.op]}-{self.a}-{self.b}"

    @property
    def split(self) -> Split:
        digest = hashlib.sha256(f"{self.a}{self.op}{self.b}".encode()).digest()
        return "val" if int.from_bytes(digest[:4], "big") < VAL_FRACTION * 2**32 else "train"


def draw(rng: random.Random) -> Problem:
    """One problem: operands of one to three digits; divisions come out exact."""
    op = rng.choice(OPERATIONS)
    phrase = rng.randrange(len(_PHRASES[op]))
    if op == "/":
        b = rng.randint(2, 30)
        return Problem(b * rng.randint(2, 40), op, b, phrase)
    if op == "*":
        return Problem(rng.randint(2, 99), op, rng.randint(2, 99), phrase)
    a, b = rng.randint(10, 999), rng.randint(1, 999)
    if op == "-" and b > a:
        a, b = b, a
    return Problem(a, op, b, phrase)


def problems(split: Split, n: int, seed: int) -> list[Problem]:
    """`n` distinct problems of `split`, drawn in a fixed order from `seed`."""
    rng = random.Random(f"calculator/{split}/{seed}")
    seen: set[str] = set()
    found: list[Problem] = []
    while len(found) < n:
        problem = draw(rng)
        if problem.split == split and problem.task_id not in seen:
            seen.add(problem.task_id)
            found.append(problem)
    return found


def task_line(problem: Problem, group_size: int | None = None) -> dict[str, Any]:
    """The problem as a line of a harnessrl task file."""
    line: dict[str, Any] = {
        "task_id": problem.task_id,
        "input": {"question": problem.question},
        "split": problem.split,
        "metadata": {"answer": str(problem.answer), "match": "numeric"},
    }
    if group_size is not None:
        line["group_size"] = group_size
    return line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", choices=("train", "val"), required=True)
    parser.add_argument("--n", type=int, default=100, help="number of tasks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--group-size", type=int, default=None)
    args = parser.parse_args(argv)
    for problem in problems(args.split, args.n, args.seed):
        sys.stdout.write(json.dumps(task_line(problem, args.group_size)) + "\n")


if __name__ == "__main__":
    main()
