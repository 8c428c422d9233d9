"""A scripted harness for `harnessrl doctor`'s tests: the calculator agent's tool loop over
three questions, with one production habit switched on by the task's `script`:

- `clean`: nothing: one conversation, history appended to, never edited;
- `system_prompt`: the system prompt's third line carries a fresh request id on every call
  (what Claude Code's per-request header line does to merging);
- `sub_agent`: before each question, a helper conversation of its own (a sub-agent
  summarising the task) whose answer the main conversation then reads;
- `compaction`: after the first question the history is replaced by a summary;
- `max_tokens`: asks for a 100,000-token budget (Claude Code asks for 32,000-64,000);
- `bad_tool_call`: a stop sequence that cuts every tool call's JSON before it closes;
- `constant`: reports the same score for every episode (a reward without a signal).

The result is `{"answer", "score"}`: the score is random per episode except under
`constant`; `score` below is the reward entrypoint that reads it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import uuid
from pathlib import Path
from typing import Any

import openai

from harnessrl.services.reward.episode import Episode, Score

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository
from examples.calculator.harness import MODEL, SYSTEM_PROMPT, TOOLS  # the demo harness's own

QUESTIONS = ("What is 235 plus 181?", "What is 17 times 23?", "What is 90 minus 48?")


def score(episode: Episode) -> Score:
    result: Any = episode.result if isinstance(episode.result, dict) else {}
    return Score(float(result.get("score", 0.0)))


class Agent:
    def __init__(self, script: str) -> None:
        self.script = script
        self.client = openai.OpenAI(max_retries=4)
        self.messages: list[Any] = [{"role": "system", "content": SYSTEM_PROMPT}]

    def call(self, messages: list[Any], tools: bool = True) -> Any:
        extra: dict[str, Any] = {"max_tokens": 48}
        if self.script == "max_tokens":
            extra["max_tokens"] = 100_000
        if self.script == "bad_tool_call":
            extra["stop"] = ["}}"]
        if self.script == "system_prompt":
            system = f"{SYSTEM_PROMPT}\nclient: doctor-test\nx-request-id: {uuid.uuid4()}"
            messages = [{"role": "system", "content": system}, *messages[1:]]
        return (
            self.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                **({"tools": TOOLS} if tools else {}),
                **extra,
            )
            .choices[0]
            .message
        )

    def ask(self, question: str) -> str:
        self.messages.append({"role": "user", "content": question})
        for _ in range(2):
            message = self.call(self.messages)
            self.messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
            if not message.tool_calls:
                return message.content or ""
            for tool_call in message.tool_calls:
                self.messages.append(
                    {"role": "tool", "tool_call_id": tool_call.id, "content": "42"}
                )
        return ""

    def helper(self, question: str) -> str:
        """A sub-agent: its own conversation, its own system prompt."""
        messages = [
            {"role": "system", "content": "You summarise tasks in one line."},
            {"role": "user", "content": f"Summarise: {question}"},
        ]
        return self.call(messages, tools=False).content or ""

    def run(self) -> str:
        answer = ""
        for i, question in enumerate(QUESTIONS):
            asked = question
            if self.script == "sub_agent":
                asked = f"{question} (task: {self.helper(question)[:40]})"
            if self.script == "compaction" and i == 1:
                summary = "Summary so far: one sum was computed with the calculator."
                self.messages = [self.messages[0], {"role": "user", "content": summary}]
            answer = self.ask(asked)
        return answer


def main() -> None:
    task = json.loads(os.environ["HARNESSRL_TASK"])
    script = task.get("script", "clean")
    answer = Agent(script).run()
    value = 1.0 if script == "constant" else random.random()
    with open(os.environ["HARNESSRL_OUTPUT"], "w") as f:
        json.dump({"answer": answer, "score": value}, f)


if __name__ == "__main__":
    main()
