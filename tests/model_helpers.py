"""Making models behave in tests: overfit a copy of the tiny model on chosen replies.

The committed tiny model is randomly initialised, so it never chooses, say, a tool call on
its own. Tests that need a specific greedy reply train a copy for a few hundred steps on
exactly that reply: real weights doing a real thing, not a stub.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-model"


def overfit(
    out: Path,
    examples: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, str]],
    *,
    steps: int = 150,
    source: Path = TINY,
) -> Path:
    """Copy `source` to `out` and train it so that, for each (messages, tools, reply), greedy
    decoding after the chat prompt yields `reply` followed by the end-of-turn token."""
    shutil.copytree(source, out, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.train()
    batch = []
    for messages, tools, reply in examples:
        prompt = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        ids = prompt_ids + reply_ids + [tokenizer.eos_token_id]
        labels = [-100] * len(prompt_ids) + reply_ids + [tokenizer.eos_token_id]
        batch.append((torch.tensor([ids]), torch.tensor([labels])))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(steps):
        for ids, labels in batch:
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(out)
    return out
