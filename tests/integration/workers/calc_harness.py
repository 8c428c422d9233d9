"""The calculator agent (examples/calculator/harness.py: its tool loop, tool and stopping
rule) as the controller tests run it: no system prompt and another model name, the
conversation the tests' overfit model was trained on. It knows nothing of training: it reads
its task from HARNESSRL_TASK, talks to whatever OPENAI_BASE_URL says, and writes its answer
to HARNESSRL_OUTPUT.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # run as a script: the repository
from examples.calculator.harness import solve  # the demo harness's own loop


def main() -> None:
    task = json.loads(os.environ["HARNESSRL_TASK"])
    client = openai.OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
    result = solve(client, task["question"], model="gpt-4o-mini", system_prompt=None)
    with open(os.environ["HARNESSRL_OUTPUT"], "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
