"""The tiny chat model shipped in examples/tiny-model: tokens, chat template, forward pass,
and that the committed files are exactly what `build.py --seed 0` makes."""

from __future__ import annotations

import importlib.util
import json
import sys
import unicodedata
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

MODEL_DIR = Path(__file__).resolve().parents[2] / "examples" / "tiny-model"
SOURCES = {"build.py", "pretrain.py", "README.md"}

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
CALL_TEXT = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_model_build", MODEL_DIR / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], **kw: Any) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    assert isinstance(text, str)
    return text


def _call(arguments: dict[str, Any] | str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "calculator", "arguments": arguments}}


def test_control_tokens_are_single_ids_dropped_when_skipping_special_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = {t: tokenizer.encode(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert all(len(v) == 1 for v in ids.values())
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == ids["<|im_end|>"][0]
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer.model_max_length == 4096
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == "user\nhi\n"


def test_tool_tokens_are_single_ids_kept_when_skipping_special_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    for token in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tokenizer.encode(token)) == 1
    text = CALL_TEXT + "<|im_end|>"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=True) == CALL_TEXT


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "What is 17 + 25?\n42",
        '{"name": "calculator", "arguments": {"expression": "17 + 25"}}',
        "  indented\n\tcode = [1, 2]  \r\n\n",
        "naïve café, Zürich, Ελληνικά, 日本語, emoji 🙂🚀, zero\u200bwidth",
        "never seen: qzxv_wkj(ℵ₀) ≠ ∅ ~~ \\u1234 \x00\x7f",
    ],
)
def test_text_round_trips_through_encode_and_decode(
    tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_text_is_nfc_normalised_as_qwen2_does(tokenizer: PreTrainedTokenizerBase) -> None:
    decomposed = "cafe\u0301"
    assert tokenizer.decode(tokenizer.encode(decomposed)) == unicodedata.normalize(
        "NFC", decomposed
    )


def test_autotokenizer_loads_the_committed_pipeline_unchanged(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # transformers 5 loads a qwen2 checkpoint through Qwen2Tokenizer, which rebuilds the
    # normaliser and pre-tokeniser itself; they must be the ones in tokenizer.json.
    committed = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    assert json.loads(tokenizer.backend_tokenizer.to_str()) == committed
    assert len(tokenizer) == 2048


def test_template_renders_user_and_assistant_turns_without_a_default_system_turn(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert _render(tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_generation_prompt_opens_an_assistant_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert _render(tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_tools_are_listed_in_the_default_system_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    text = _render(tokenizer, [{"role": "user", "content": "Hi"}], tools=[CALCULATOR])
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(CALCULATOR)
        + "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nHi<|im_end|>\n"
    )


def test_tools_are_appended_to_a_given_system_message_one_line_each(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    other = {**CALCULATOR, "function": {**CALCULATOR["function"], "name": "search"}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = _render(tokenizer, messages, tools=[CALCULATOR, other])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n\n")
    assert f"<tools>\n{json.dumps(CALCULATOR)}\n{json.dumps(other)}\n</tools>" in text
    assert "You are a helpful assistant." not in text


def test_tool_calls_and_results_render_as_hermes_blocks(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "user", "content": "What is 17 + 25?"},
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [_call({"expression": "17 + 25"})],
        },
        {"role": "tool", "content": "42"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call('{"expression": "6 * 7"}')] * 2,
        },
        {"role": "tool", "content": "42"},
    ]
    call_67 = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
    )
    assert _render(tokenizer, messages) == (
        "<|im_start|>user\nWhat is 17 + 25?<|im_end|>\n"
        f"<|im_start|>assistant\nLet me compute.\n{CALL_TEXT}<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n{call_67}\n{call_67}<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n"
    )


def test_multipart_content_renders_as_its_concatenated_texts(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": parts},
        {"role": "tool", "content": [{"type": "text", "text": "4"}]},
    ]
    assert _render(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>\n4\n</tool_response><|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("generated", "message"),
    [
        ("The answer is 42.", {"content": "The answer is 42."}),
        ("  The answer\nis 42.\n", {"content": "  The answer\nis 42.\n"}),
        (
            "Let me compute.\n" + CALL_TEXT,
            {"content": "Let me compute.", "tool_calls": [_call({"expression": "17 + 25"})]},
        ),
        (CALL_TEXT, {"content": None, "tool_calls": [_call('{"expression": "17 + 25"}')]}),
        (
            CALL_TEXT + "\n" + CALL_TEXT,
            {"content": "", "tool_calls": [_call('{"expression": "17 + 25"}')] * 2},
        ),
    ],
)
def test_rendering_extends_the_previous_rendering_by_the_generated_text(
    tokenizer: PreTrainedTokenizerBase, generated: str, message: dict[str, Any]
) -> None:
    """An earlier assistant turn renders exactly as generated, whether the harness sends it
    back as parsed tool calls or as raw text, so the next prompt extends the previous one."""
    history = [{"role": "user", "content": "What is 17 + 25?"}]
    prompt = _render(tokenizer, history, tools=[CALCULATOR], add_generation_prompt=True)
    for reply in ({"role": "assistant", **message}, {"role": "assistant", "content": generated}):
        extended = [*history, reply, {"role": "tool", "content": "42"}]
        again = _render(tokenizer, extended, tools=[CALCULATOR], add_generation_prompt=True)
        assert again.startswith(prompt + generated + "<|im_end|>")
        # ... and in tokens, which is what the trainer merges on.
        expected = tokenizer.encode(prompt) + tokenizer.encode(generated) + [tokenizer.eos_token_id]
        assert tokenizer.encode(again)[: len(expected)] == expected


def test_build_renderer_matches_the_saved_template(
    tokenizer: PreTrainedTokenizerBase, build: ModuleType
) -> None:
    import random

    rng = random.Random(1)
    for _ in range(50):
        dialogue = build.synthetic_dialogue(rng)
        saved = _render(tokenizer, dialogue.messages, tools=dialogue.tools)
        assert build.render(dialogue) == saved


def test_forward_pass_gives_logits_over_the_vocabulary(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == [
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    ]
    ids = tokenizer(
        _render(tokenizer, [{"role": "user", "content": "Hi"}], add_generation_prompt=True),
        return_tensors="pt",
    ).input_ids  # (1, n)
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # (1, n, vocab)
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


def _unstamped(path: Path) -> bytes:
    """The file's bytes, without the `"transformers_version"` line transformers writes into
    its JSON files. The stamp says which release wrote the file, not what the build decided:
    requirements/dev.lock pins that release, and a deliberate `make lock UPGRADE=1` may move
    it without changing one weight, token or setting (anything else that moves still fails)."""
    lines = path.read_bytes().splitlines(keepends=True)
    if path.suffix != ".json":
        return b"".join(lines)
    return b"".join(
        line for line in lines if not line.lstrip().startswith(b'"transformers_version"')
    )


def test_committed_artifacts_equal_a_fresh_build(build: ModuleType, tmp_path: Path) -> None:
    tokenizer = build.build_tokenizer(0)
    build.save(tmp_path, tokenizer, build.build_model(tokenizer, 0))
    committed = {p.name for p in MODEL_DIR.iterdir() if p.is_file()} - SOURCES
    assert {p.name for p in tmp_path.iterdir()} == committed
    for name in sorted(committed):
        fresh, kept = _unstamped(tmp_path / name), _unstamped(MODEL_DIR / name)
        assert fresh == kept, f"{name}: rebuild with `python examples/tiny-model/build.py`"
