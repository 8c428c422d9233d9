"""The calculator agent: a harness written the way a user writes one, unaware of training.

Plain Python on the `openai` SDK. It reads its task from HARNESSRL_TASK, talks to whatever
OPENAI_BASE_URL points at (the real API in production, the harnessrl gateway in training),
runs a tool loop with a calculator, and stops on its own rule: the model answers without
calling a tool, repeats a call it already made, or has used MAX_CALLS model calls. It writes
its answer to HARNESSRL_OUTPUT (or prints it when run by hand), and beside it, after each
answer it gets, `progress.json` with the calls answered so far (what an operator, or
`harnessrl chaos`, reads of a run that was killed before it wrote a result):

    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=x \\
        python examples/calculator/harness.py "What is 17 times 23?"
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai

MODEL = "calculator-agent"
SYSTEM_PROMPT = "You are a careful assistant. Use the calculator for arithmetic."
MAX_CALLS = 4
MAX_TOKENS = 48
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (+ - * / // and parentheses), as text."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        raise ValueError(f"not arithmetic: {expression!r}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def run_tool(arguments: str) -> str:
    try:
        return calculate(json.loads(arguments)["expression"])
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError) as err:
        return f"error: {err}"


def solve(
    client: openai.OpenAI,
    question: str,
    answered: Callable[[int], None] | None = None,
    *,
    model: str = MODEL,
    system_prompt: str | None = SYSTEM_PROMPT,
) -> dict[str, Any]:
    """Run the tool loop; `answered(n)` is called when the n-th model call has returned.
    `model` and `system_prompt` (None: no system message) are what the agent sends."""
    messages: list[Any] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    made: set[str] = set()
    tool_calls = 0
    for calls in range(1, MAX_CALLS + 1):
        response = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0
        )
        if answered is not None:
            answered(calls)
        message = response.choices[0].message
        if not message.tool_calls:
            return {"answer": (message.content or "").strip(), "calls": calls, "tools": tool_calls}
        requested = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        if all(json.dumps(r) in made for r in requested):
            break  # going round in circles
        made.update(json.dumps(r) for r in requested)
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            tool_calls += 1
            result = (
                run_tool(call.function.arguments)
                if call.function.name == "calculator"
                else (f"error: no tool named {call.function.name!r}")
            )
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return {"answer": "", "calls": calls, "tools": tool_calls}


PROGRESS = "progress.json"


def _progress(path: Path) -> Callable[[int], None]:
    def write(calls: int) -> None:
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps({"calls": calls}))
        partial.replace(path)  # whole or not at all, however the run ends

    return write


def main() -> None:
    if len(sys.argv) > 1:
        question = " ".join(sys.argv[1:])
    else:
        question = json.loads(os.environ["HARNESSRL_TASK"])["question"]
    client = openai.OpenAI(max_retries=8)  # OPENAI_BASE_URL, OPENAI_API_KEY from the environment
    output = os.environ.get("HARNESSRL_OUTPUT")
    result = solve(
        client, question, _progress(Path(output).with_name(PROGRESS)) if output else None
    )
    if output:
        with open(output, "w") as f:
            json.dump(result, f)
    else:
        sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
