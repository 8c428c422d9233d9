"""Episode shapes for `harnessrl bench samples`: what real harnesses send, and the least
sequence tokens their chains need.

Each shape plays one episode's calls (ids only, seeded) and says how many tokens the
minimal set of training sequences holds: one sequence per conversation the harness ran,
each as long as that conversation's last context. The builder's sequences are measured
against it (1.0: nothing trained twice, nothing split that did not have to be).

- linear: one tool loop of 8 calls;
- thinking: 4 user turns of 3 calls each, every completion a reasoning block then an
  answer; at each new user turn the template drops the earlier turns' reasoning (Qwen3), so
  each user turn is a conversation of its own;
- sub_agent: a main loop of 8 calls and, interleaved with it, a sub-agent's own loop of 4
  calls under its own system prompt;
- compaction: 6 calls, then the history replaced by a summary, then 4 more calls;
- side_calls: a main loop of 8 calls, each followed by 16 independent side calls.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

Ids = npt.NDArray[np.uint32]
Call = tuple[Ids, Ids]
"""(prompt ids, completion ids)."""
VOCAB = 151_000


def _ids(rng: np.random.Generator, low: int, high: int) -> Ids:
    return rng.integers(0, VOCAB, int(rng.integers(low, high + 1)), dtype=np.uint32)


def _cat(*parts: Ids) -> Ids:
    return np.concatenate(parts).astype(np.uint32, copy=False)


def _loop(rng: np.random.Generator, prompt: Ids, calls: int) -> tuple[list[Call], Ids]:
    """A tool loop from `prompt`: (its calls, its last context)."""
    out: list[Call] = []
    context = prompt
    for _ in range(calls):
        completion = _ids(rng, 100, 500)
        out.append((context, completion))
        last = _cat(context, completion)
        context = _cat(last, _ids(rng, 50, 300))
    return out, last


def linear(rng: np.random.Generator) -> tuple[list[Call], int]:
    calls, last = _loop(rng, _ids(rng, 1000, 2000), 8)
    return calls, len(last)


def thinking(rng: np.random.Generator) -> tuple[list[Call], int]:
    system = _ids(rng, 1000, 2000)
    turns: list[list[tuple[Ids, Ids, Ids]]] = []  # per user turn: (think, answer, inserted)
    users: list[Ids] = []
    calls: list[Call] = []
    minimal = 0
    for _ in range(4):
        users.append(_ids(rng, 20, 200))
        turns.append([])
        for step in range(3):
            # Earlier user turns render without their reasoning; this one keeps it.
            history = [system]
            for k, user in enumerate(users):
                history.append(user)
                for think, answer, inserted in turns[k]:
                    history += (
                        [think, answer, inserted] if k == len(users) - 1 else [answer, inserted]
                    )
            prompt = _cat(*history)
            think, answer = _ids(rng, 100, 400), _ids(rng, 20, 150)
            calls.append((prompt, _cat(think, answer)))
            last = len(prompt) + len(think) + len(answer)
            turns[-1].append((think, answer, _ids(rng, 50, 300) if step < 2 else _ids(rng, 0, 0)))
        minimal += last
    return calls, minimal


def sub_agent(rng: np.random.Generator) -> tuple[list[Call], int]:
    main, main_last = _loop(rng, _ids(rng, 1000, 2000), 8)
    sub, sub_last = _loop(rng, _ids(rng, 500, 1000), 4)
    calls = [*main[:3], sub[0], main[3], sub[1], sub[2], main[4], sub[3], *main[5:]]
    return calls, len(main_last) + len(sub_last)


def compaction(rng: np.random.Generator) -> tuple[list[Call], int]:
    system = _ids(rng, 1000, 2000)
    before, before_last = _loop(rng, _cat(system, _ids(rng, 20, 200)), 6)
    summary = _cat(system, _ids(rng, 200, 600))  # the history replaced by a summary
    after, after_last = _loop(rng, summary, 4)
    return [*before, *after], len(before_last) + len(after_last)


def side_calls(rng: np.random.Generator) -> tuple[list[Call], int]:
    """A main loop of 8 calls with 16 independent side calls (a classifier, a guard model:
    a short system prompt of their own) after each: 129 chains, more than a break is
    compared with, so the cost per call must not grow with them."""
    main, main_last = _loop(rng, _ids(rng, 1000, 2000), 8)
    system = _ids(rng, 100, 200)
    calls: list[Call] = []
    minimal = len(main_last)
    for call in main:
        calls.append(call)
        for _ in range(16):
            prompt, completion = _cat(system, _ids(rng, 50, 300)), _ids(rng, 5, 40)
            calls.append((prompt, completion))
            minimal += len(prompt) + len(completion)
    return calls, minimal


SHAPES: dict[str, Callable[[np.random.Generator], tuple[list[Call], int]]] = {
    "linear": linear,
    "thinking": thinking,
    "sub_agent": sub_agent,
    "compaction": compaction,
    "side_calls": side_calls,
}
