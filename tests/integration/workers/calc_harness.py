"""A harness as a user writes one: the `openai` SDK, a calculator tool, a tool loop.

It knows nothing of training: it reads its task from HARNESSRL_TASK, talks to whatever
OPENAI_BASE_URL says, and writes its answer to HARNESSRL_OUTPUT.
"""

from __future__ import annotations

import ast
import json
import operator
import os

import openai

TOOLS = [
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
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        raise ValueError(f"unsupported: {expression}")

    value = walk(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else str(value)


def main() -> None:
    task = json.loads(os.environ["HARNESSRL_TASK"])
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    messages: list[dict[str, object]] = [{"role": "user", "content": task["question"]}]
    calls = 0
    for _ in range(4):  # its own stopping rule: at most four model calls
        response = client.chat.completions.create(
            model="gpt-4o-mini", messages=messages, tools=TOOLS, max_tokens=48, temperature=0
        )
        calls += 1
        message = response.choices[0].message
        if not message.tool_calls:
            answer = (message.content or "").strip()
            break
        messages.append(
            {
                "role": "assistant",
                "content": message.content,
                "tool_calls": [c.model_dump() for c in message.tool_calls],
            }
        )
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except (ValueError, KeyError, SyntaxError, json.JSONDecodeError) as err:
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    else:
        answer = ""
    with open(os.environ["HARNESSRL_OUTPUT"], "w") as out:
        json.dump({"answer": answer, "calls": calls}, out)


if __name__ == "__main__":
    main()
