"""Simulated users of the help desk: they ask, check the answer, and sometimes press a thumb.

Each user asks one train problem of examples/calculator/tasks.py after another (a short
pause between), knows its result, and judges the desk's answer by the last number in it
(as the calculator demo's reward does). After a random delay (exponential, mean
`thumbs_mean_s`) a user presses thumbs up for a right answer and down for a wrong one;
a share `silent` of the time a user never presses anything. Users run concurrently until
the deadline; each conversation's outcome is one record.

    python -m examples.production.users --app http://127.0.0.1:8300 --users 12 --minutes 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from examples.calculator.reward import stated
from examples.calculator.tasks import Problem, problems


@dataclass(slots=True)
class Outcome:
    """One conversation, as its user saw it. Times are unix seconds."""

    user: str
    conversation: str
    kind: str
    question: str
    expected: int
    answer: str
    correct: bool
    asked_at: float
    answered_at: float
    response_ids: list[str] = field(default_factory=list)
    thumbs: bool | None = None
    """Up (True), down (False), or never pressed (None)."""
    thumbs_at: float | None = None
    thumbs_status: int | None = None
    """The app's answer to the thumbs (202: the feedback service has it)."""


@dataclass(frozen=True, slots=True)
class Behaviour:
    users: int = 8
    thumbs_mean_s: float = 3.0
    silent: float = 0.15
    pause_s: float = 0.2
    seed: int = 0


def correct(answer: str, expected: int) -> bool:
    value = stated(answer)
    return value is not None and math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-6)


async def run_users(
    app_url: str,
    seconds: float,
    behaviour: Behaviour = Behaviour(),
    on_outcome: Callable[[Outcome], None] = lambda _: None,
) -> list[Outcome]:
    """Run `behaviour.users` users against the app for `seconds`, then wait for the thumbs
    still to press (at most 4 mean delays); returns every conversation's outcome in the
    order answered. `on_outcome` is called once per answer (its thumbs may come later)."""
    pool = problems("train", 3000, seed=behaviour.seed + 1)
    outcomes: list[Outcome] = []
    pending: set[asyncio.Task[None]] = set()
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(base_url=app_url, timeout=180.0) as client:

        async def user(number: int) -> None:
            rng = random.Random(f"user/{behaviour.seed}/{number}")
            name = f"user{number}"
            while time.monotonic() < deadline:
                outcome = await ask(client, name, rng.choice(pool))
                outcomes.append(outcome)
                on_outcome(outcome)
                if rng.random() >= behaviour.silent:
                    delay = rng.expovariate(1.0 / behaviour.thumbs_mean_s)
                    task = asyncio.create_task(press(client, outcome, delay))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                await asyncio.sleep(rng.expovariate(1.0 / behaviour.pause_s))

        await asyncio.gather(*(user(n) for n in range(behaviour.users)))
        if pending:
            await asyncio.wait(set(pending), timeout=4 * behaviour.thumbs_mean_s + 20)
    return outcomes


async def ask(client: httpx.AsyncClient, user: str, problem: Problem) -> Outcome:
    asked = time.time()
    response = await client.post("/ask", json={"user": user, "question": problem.question})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return Outcome(
        user=user,
        conversation=body["conversation"],
        kind=body["kind"],
        question=problem.question,
        expected=problem.answer,
        answer=body["answer"],
        correct=correct(body["answer"], problem.answer),
        asked_at=asked,
        answered_at=time.time(),
        response_ids=body["response_ids"],
    )


async def press(client: httpx.AsyncClient, outcome: Outcome, delay: float) -> None:
    await asyncio.sleep(delay)
    up = outcome.correct
    response = await client.post("/thumbs", json={"conversation": outcome.conversation, "up": up})
    outcome.thumbs, outcome.thumbs_at, outcome.thumbs_status = up, time.time(), response.status_code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--app", required=True, help="the help desk's base URL")
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    behaviour = Behaviour(users=args.users, seed=args.seed)
    outcomes = asyncio.run(run_users(args.app, args.minutes * 60, behaviour))
    for outcome in outcomes:
        sys.stdout.write(json.dumps(asdict(outcome)) + "\n")


if __name__ == "__main__":
    main()
