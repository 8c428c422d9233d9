"""Pretrain the tiny model into the calculator demo's base policy (supervised fine-tuning).

The demo needs a base model that can already play the calculator harness's game, but not
well, so reinforcement learning has something to improve. This script fine-tunes the
random tiny model (this folder) on synthetic dialogues in exactly the format the harness
produces: its system prompt and tool, rendered by the model's own chat template, token by
token as the engine will see them. The dialogues are drawn from the train split only and
are deliberately imperfect, like transcripts of a careless assistant:

- it uses the calculator for most sums but for fewer than half of the differences,
  products and quotients; otherwise it states a guessed (wrong) number straight away;
- it sometimes copies an operand into the calculator wrongly;
- it sometimes misreports the calculator's result.

So the base model calls the tool for some kinds of problem and guesses on the rest. Using
the tool and copying faithfully is what earns reward; RL has to find that out.

    .venv/bin/python examples/tiny-model/pretrain.py            # into calculator/, seed 0
    .venv/bin/python examples/tiny-model/pretrain.py --steps 300 --out /tmp/base

Deterministic for a seed on a given machine and thread count. It ends with an offline check
of the result on val problems (the harness's loop, simulated in-process) and writes the
figures to `training.json` beside the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "calculator"))

import harness  # noqa: E402  (examples/calculator/harness.py: the prompt and tool it uses)
import tasks  # noqa: E402  (examples/calculator/tasks.py: the problems and their splits)

TOOL_USE = {"+": 0.8, "-": 0.4, "*": 0.4, "/": 0.4}
"""How often the pretraining assistant reaches for the calculator, by operation."""
MISCOPY = 0.06
"""Of the calculator calls: how often an operand is copied with one digit wrong."""
MISREPORT = 0.04
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
"""Of the faithful calculator calls: how often the stated answer has one digit wrong."""


@dataclass(frozen=True)
class Recipe:
    seed: int = 0
    dialogues: int = 24000
    steps: int = 2500
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01


def _garble(number: int, rng: random.Random) -> int:
    """`number` with one digit changed (never equal to it, never 0)."""
    text = str(number)
    while True:
        sign = "-" if text.startswith("-") else ""
        digits = list(text.lstrip("-"))
        i = rng.randrange(len(digits))
        digits[i] = str(rng.choice([d for d in range(10) if str(d) != digits[i]]))
        if digits[0] == "0":
            continue  # no leading zeros, and never 0 (a divisor)
        return int(sign + "".join(digits))


def _guess(answer: int, rng: random.Random) -> int:
    """A confident wrong answer of about the right size."""
    if rng.random() < 0.5:
        return _garble(answer, rng)
    guess = answer + rng.choice([-1, 1]) * rng.randint(1, max(2, abs(answer) // 5))
    return guess if guess != answer else answer + 1


def _final(value: int) -> dict[str, Any]:
    return {"role": "assistant", "content": f"The answer is {value}."}


def dialogue(problem: tasks.Problem, rng: random.Random) -> list[dict[str, Any]]:
    """One imperfect conversation about `problem`, in the messages the harness sends."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": harness.SYSTEM_PROMPT},
        {"role": "user", "content": problem.question},
    ]
    if rng.random() >= TOOL_USE[problem.op]:
        return [*messages, _final(_guess(problem.answer, rng))]
    a, b = problem.a, problem.b
    if rng.random() < MISCOPY:
        if rng.random() < 0.5:
            a = _garble(a, rng)
        else:
            b = _garble(b, rng)
    expression = f"{a} {problem.op} {b}"
    result = harness.calculate(expression)
    call = {
        "id": f"call_{rng.getrandbits(48):012x}",
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    stated = int(float(result)) if _is_int(result) else problem.answer
    if expression == problem.expression and rng.random() < MISREPORT:
        stated = _garble(stated, rng)
    return [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": result},
        _final(stated),
    ]


def _is_int(text: str) -> bool:
    try:
        return float(text).is_integer()
    except ValueError:
        return False


def encode(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and a mask of the assistant's tokens (the ones the
    engine would have generated: each reply and its end-of-turn token)."""

    def render(upto: int, generation: bool) -> list[int]:
        ids: list[int] = tokenizer.apply_chat_template(
            messages[:upto],
            tools=harness.TOOLS,
            add_generation_prompt=generation,
            tokenize=True,
            return_dict=False,
        )
        return ids

    ids = render(len(messages), False)
    mask = [0] * len(ids)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(k, True)
        if ids[: len(prompt)] != prompt:
            raise AssertionError("the chat template rewrote an earlier turn")
        stop = ids.index(end, len(prompt))
        for i in range(len(prompt), stop + 1):
            mask[i] = 1
    return ids, mask


def train(recipe: Recipe, init: Path, progress: bool = True) -> tuple[Any, Any, list[float]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(init)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    rng = random.Random(recipe.seed)
    pool = tasks.problems("train", 6000, seed=1000 + recipe.seed)
    data = [encode(tokenizer, dialogue(rng.choice(pool), rng)) for _ in range(recipe.dialogues)]
    pad = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay, betas=(0.9, 0.98)
    )

    def lr_at(step: int) -> float:
        if step < recipe.warmup:
            return recipe.lr * (step + 1) / recipe.warmup
        done = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
        return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    model.train()
    losses: list[float] = []
    started = time.monotonic()
    order = list(range(len(data)))
    cursor = len(order)
    for step in range(recipe.steps):
        if cursor + recipe.batch > len(order):
            rng.shuffle(order)
            cursor = 0
        batch = [data[i] for i in order[cursor : cursor + recipe.batch]]
        cursor += recipe.batch
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (seq, mask) in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
            target = torch.tensor([t if m else -100 for t, m in zip(seq, mask, strict=True)])
            labels[row, : len(seq)] = target
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        # Logits only where a token is trained (~a sixth of them): the prompt is context.
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
        targets = labels[:, 1:]
        trained = targets != -100  # [B, T-1]
        logits = model.lm_head(hidden[:, :-1][trained])  # [N, vocab]
        loss = torch.nn.functional.cross_entropy(logits, targets[trained])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if progress and (step + 1) % 50 == 0:
            recent = sum(losses[-50:]) / 50
            elapsed = time.monotonic() - started
            eta = elapsed / (step + 1) * (recipe.steps - step - 1)
            sys.stderr.write(
                f"step {step + 1}/{recipe.steps}  loss {recent:.4f}  "
                f"{elapsed:.0f}s elapsed, ~{eta:.0f}s left\n"
            )
    model.eval()
    return model, tokenizer, losses


def evaluate(
    model: Any, tokenizer: Any, problems: list[tasks.Problem], temperature: float, seed: int = 0
) -> dict[str, Any]:
    """The harness's loop, simulated in-process with batched generation: success rate and
    how often the first reply called the calculator, overall and by operation."""
    import torch

    from harnessrl.services.inference.tools import parse_tool_calls

    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    conversations: list[list[dict[str, Any]]] = [
        [
            {"role": "system", "content": harness.SYSTEM_PROMPT},
            {"role": "user", "content": p.question},
        ]
        for p in problems
    ]
    answers: list[str | None] = [None] * len(problems)
    first_tool = [False] * len(problems)
    active = list(range(len(problems)))
    for turn in range(harness.MAX_CALLS):
        if not active:
            break
        texts = [
            tokenizer.apply_chat_template(
                conversations[i], tools=harness.TOOLS, add_generation_prompt=True, tokenize=False
            )
            for i in active
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **batch,
                max_new_tokens=harness.MAX_TOKENS,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=None,
                top_k=None,
            )
        still = []
        for row, i in enumerate(active):
            generated = out[row, batch["input_ids"].shape[1] :]
            reply = tokenizer.decode(generated, skip_special_tokens=True)
            content, calls = parse_tool_calls(reply)
            if not calls:
                answers[i] = (content or reply).strip()
                continue
            first_tool[i] = first_tool[i] or turn == 0
            message = {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments},
                    }
                    for c in calls
                ],
            }
            conversations[i].append(message)
            for c in calls:
                conversations[i].append(
                    {"role": "tool", "tool_call_id": c.id, "content": harness.run_tool(c.arguments)}
                )
            still.append(i)
        active = still
    by_op: dict[str, dict[str, float]] = {}
    solved = 0
    for problem, answer, tool in zip(problems, answers, first_tool, strict=True):
        ok = answer is not None and _states(answer, problem.answer)
        solved += ok
        entry = by_op.setdefault(problem.op, {"n": 0, "success": 0.0, "tool": 0.0})
        entry["n"] += 1
        entry["success"] += ok
        entry["tool"] += tool
    for entry in by_op.values():
        entry["success"] = round(entry["success"] / entry["n"], 3)
        entry["tool"] = round(entry["tool"] / entry["n"], 3)
    return {"temperature": temperature, "success": round(solved / len(problems), 3), "by_op": by_op}


def _states(reply: str, expected: int) -> bool:
    import re

    found = re.findall(r"-?\d+(?:\.\d+)?", reply.replace(",", ""))
    return bool(found) and math.isclose(float(found[-1]), expected, abs_tol=1e-6)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "calculator")
    parser.add_argument("--init", type=Path, default=HERE, help="model to start from")
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--eval-tasks", type=int, default=200)
    args = parser.parse_args(argv)
    import torch
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    torch.set_num_threads(2)
    recipe = Recipe(seed=args.seed, steps=args.steps)
    started = time.monotonic()
    model, tokenizer, losses = train(recipe, args.init)
    minutes = (time.monotonic() - started) / 60
    val = tasks.problems("val", args.eval_tasks, seed=0)
    figures = {
        "greedy": evaluate(model, tokenizer, val, temperature=0.0),
        "sampled": evaluate(model, tokenizer, val, temperature=1.0),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:  # the same tokens, byte for byte
        shutil.copyfile(args.init / name, args.out / name)
    model.save_pretrained(args.out, safe_serialization=True)
    report = {
        "recipe": recipe.__dict__,
        "mixture": {"tool_use": TOOL_USE, "miscopy": MISCOPY, "misreport": MISREPORT},
        "final_loss": round(sum(losses[-100:]) / min(100, len(losses)), 4),
        "minutes": round(minutes, 1),
        "val_offline": figures,
    }
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))  # noqa: T201


if __name__ == "__main__":
    main()
