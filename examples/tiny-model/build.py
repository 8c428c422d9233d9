"""Build the tiny chat model the project ships: a byte-level BPE tokenizer, a Qwen2.5-style
chat template with tool calls, and a randomly initialised Qwen2 causal LM of about 1M
parameters.

Run `python examples/tiny-model/build.py --out DIR --seed 0`. The same seed gives
byte-identical files, so the committed artifacts can be checked against a fresh build.
The functions here (the synthetic dialogues, `build_tokenizer`, `build_model`, `save`) are
meant to be reused by a later supervised pre-training step.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

VOCAB_SIZE = 2048
"""Total vocabulary, special and added tokens included (the model's embedding rows)."""

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
"""Control tokens: one id each, dropped by `skip_special_tokens`."""

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Tool markup: one id each, but kept when decoding, so a tool parser sees it."""

# Qwen2's split: letters run together, every digit alone (so numbers stay digit-wise for
# arithmetic), punctuation runs, newlines apart from other whitespace.
PRE_TOKENIZER_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Earlier turns are rendered exactly as they were generated (no stripping, no rewriting),
# so a rendering of a longer conversation always extends the rendering of a shorter one;
# the trainer merges turns by token prefix and relies on it.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is string -%}
{{- part -}}
{%- elif part.type == 'text' -%}
{{- part.text -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if has_system or tools -%}
{{- '<|im_start|>system\n' -}}
{%- if has_system -%}
{{- render_content(messages[0].content) -}}
{%- else -%}
{{- 'You are a helpful assistant.' -}}
{%- endif -%}
{%- if tools -%}
{{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}
{{- '\n' ~ (tool | tojson) -}}
{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and ' -}}
{{- 'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'tool' -%}
{{- '<|im_start|>tool\n<tool_response>\n' ~ render_content(message.content) -}}
{{- '\n</tool_response><|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set content = render_content(message.content) -%}
{{- '<|im_start|>assistant\n' ~ content -}}
{%- for tool_call in message.tool_calls or [] -%}
{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
{%- if content or not loop.first -%}
{{- '\n' -}}
{%- endif -%}
{{- '<tool_call>\n{"name": ' ~ (call.name | tojson) ~ ', "arguments": ' -}}
{%- if call.arguments is string -%}
{{- call.arguments -}}
{%- else -%}
{{- call.arguments | tojson -}}
{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' ~ message.role ~ '\n' ~ render_content(message.content) ~ '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    properties = {key: {"type": "string", "description": text} for key, text in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


TOOLS = {
    "calculator": _tool(
        "calculator", "Evaluate an arithmetic expression.", expression="The expression."
    ),
    "read_file": _tool("read_file", "Read a text file.", path="Path of the file."),
    "get_weather": _tool("get_weather", "Current weather in a city.", city="The city."),
    "search": _tool("search", "Search the web.", query="What to look for."),
}


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NAMES = _words(
    "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Mallory Oscar Peggy Trent Victor "
    "Walter Anna Maria Lucas Emma Noah Olivia Liam Sophia Mia Ethan Chloe Daniel Laura Henry "
    "Clara Samuel Nora Oliver Ruth Thomas Julia Peter Rosa Martin"
)
_NOUNS = _words(
    "cat dog bird horse fish house garden river mountain city village teacher student doctor "
    "farmer baker driver writer player engineer book letter window door table chair computer "
    "program file server network model answer question problem number story song friend "
    "family morning evening night winter summer spring autumn road street market train "
    "station library kitchen school office forest ocean island bridge tree flower apple bread "
    "water coffee paper picture camera phone message email meeting project report budget "
    "plan idea reason result error test function variable list string value key lock box "
    "bag shoe hat coat shirt boat car bicycle plane ticket map clock watch lamp bed room "
    "floor wall roof hill lake field farm shop bank hospital museum theater park beach "
    "desert valley cloud rain snow wind storm sun moon star planet engine machine tool "
    "hammer knife spoon cup plate bottle glass stone metal wood sand fire light sound voice "
    "word sentence page chapter language history science music game team club company "
    "customer manager worker child parent brother sister neighbor stranger king queen"
)
_VERBS = _words(
    "sees finds reads writes builds opens closes likes needs wants carries paints cleans "
    "checks fixes counts visits follows watches helps moves sends keeps loses tests makes "
    "takes gives brings buys sells cooks eats drinks plays sings draws learns teaches "
    "remembers forgets answers asks calls meets leaves enters crosses climbs pushes pulls "
    "throws catches holds drops breaks repairs measures compares describes explains chooses "
    "prepares orders delivers receives returns borrows shares saves prints copies deletes "
    "updates installs runs starts stops waits hears touches smells tastes"
)
_ADJECTIVES = _words(
    "small large old new quiet busy bright dark happy careful quick slow simple strange "
    "green blue red warm cold early late famous empty full heavy light long short tall "
    "young ancient modern clean dirty cheap expensive easy difficult important useful "
    "beautiful ugly strong weak loud soft hard sweet bitter fresh tired hungry angry calm "
    "brave clever curious friendly gentle honest kind lucky polite proud rich poor safe "
    "dangerous wet dry narrow wide deep shallow round square yellow white black brown"
)
_ADVERBS = _words(
    "quickly slowly carefully quietly always never often sometimes usually today yesterday "
    "tomorrow again already almost really very rather suddenly finally probably certainly"
)
_PLACES = _words(
    "Paris London Tokyo Berlin Madrid Rome Oslo Lisbon Cairo Lima Seoul Dublin Vienna Prague "
    "Warsaw Athens Sydney Toronto Chicago Boston Denver Mumbai Delhi Nairobi Lagos Santiago "
    "Bogota Havana Helsinki Stockholm Amsterdam Brussels Zurich Geneva Istanbul Bangkok Hanoi"
)
_FILES = _words(
    "notes.txt main.py README.md data.csv config.yaml todo.md report.txt app.js index.html "
    "setup.cfg train.py model.json results.tsv Makefile server.go lib.rs test_app.py"
)
_TOPICS = _words(
    "rust compilers gardening rivers trains music tea chess weather history painting "
    "astronomy cooking football languages volcanoes bees databases birds bridges"
)


def _sentence(rng: random.Random) -> str:
    """An English-like sentence."""
    a, b = rng.choice(_ADJECTIVES), rng.choice(_ADJECTIVES)
    n1, n2 = rng.choice(_NOUNS), rng.choice(_NOUNS)
    forms = (
        f"The {a} {n1} {rng.choice(_VERBS)} a {b} {n2}.",
        f"{rng.choice(_NAMES)} {rng.choice(_VERBS)} the {n1} in {rng.choice(_PLACES)}.",
        f"Every {n1} is {a}, but the {n2} is {b}.",
        f"Why does the {n1} look so {a} today?",
        f"In the {a} {n1}, {rng.choice(_NAMES)} and {rng.choice(_NAMES)} found a {n2}.",
        f"I think the {n1} was {a} because the {n2} was {b}.",
        f"{rng.choice(_NAMES)} {rng.choice(_ADVERBS)} {rng.choice(_VERBS)} the {a} {n1}.",
        f"Yesterday the {n1} {rng.choice(_VERBS)} {rng.choice(_ADVERBS)}, and it was {b}.",
    )
    return rng.choice(forms)


def _code(rng: random.Random) -> str:
    """A short Python function, so identifiers, indentation and operators get merges."""
    verb, noun, other = rng.choice(_VERBS).removesuffix("s"), rng.choice(_NOUNS), rng.choice(_NOUNS)
    op = rng.choice(("+", "-", "*", "==", "<=", "and", "or"))
    return (
        f"def {verb}_{noun}({noun}: int, {other}: int) -> int:\n"
        f'    """{rng.choice(_ADJECTIVES).capitalize()} {noun} helper."""\n'
        f'    if {noun} is None:\n        raise ValueError("missing {noun}")\n'
        f"    return {noun} {op} {other}\n"
    )


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    """An expression such as `17 + 25` and its value as text."""
    op = rng.choice("+-*")
    high, low = (12, 2) if op == "*" else (99, 0)
    a, b = rng.randint(low, high), rng.randint(low, high)
    value = a + b if op == "+" else a - b if op == "-" else a * b
    return f"{a} {op} {b}", str(value)


def _call(name: str, **arguments: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass(frozen=True)
class Dialogue:
    """One synthetic conversation in OpenAI message shape, with the tools it was offered."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = field(default=None)


def _tool_dialogue(rng: random.Random) -> list[dict[str, Any]]:
    """A user question answered through one tool call and its result."""
    kind = rng.choice(("calculator", "read_file", "get_weather", "search"))
    if kind == "calculator":
        expression, result = _arithmetic(rng)
        question, call = f"What is {expression}?", _call(kind, expression=expression)
        answer = rng.choice((f"{expression} = {result}.", f"The answer is {result}.", result))
    elif kind == "read_file":
        path = rng.choice(_FILES)
        result = _code(rng) if path.endswith(".py") else _sentence(rng)
        question, call = f"What does {path} say?", _call(kind, path=path)
        answer = f"The file {path} says: {result}"
    elif kind == "get_weather":
        city, temp = rng.choice(_PLACES), rng.randint(-5, 35)
        result = json.dumps({"city": city, "temperature": temp, "unit": "celsius"})
        question, call = f"How warm is it in {city}?", _call(kind, city=city)
        answer = f"It is {temp} degrees in {city}."
    else:
        topic = rng.choice(_TOPICS)
        question, call = f"Find something about {topic}.", _call(kind, query=topic)
        result, answer = _sentence(rng), f"Here is what I found about {topic}."
    preamble = rng.choice(("", "", "Let me check.", f"I will use {kind}."))
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": preamble, "tool_calls": [call]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": answer},
    ]


def synthetic_dialogue(rng: random.Random) -> Dialogue:
    """A random conversation: chit-chat, a bare arithmetic answer, or a tool round trip."""
    kind = rng.random()
    if kind < 0.5:
        tools = rng.sample(list(TOOLS.values()), rng.randint(1, len(TOOLS)))
        messages = _tool_dialogue(rng)
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You are a careful assistant."})
        return Dialogue(messages, tools)
    if kind < 0.75:
        expression, value = _arithmetic(rng)
        return Dialogue(
            [
                {"role": "user", "content": f"What is {expression}?"},
                {"role": "assistant", "content": value},
            ]
        )
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": _sentence(rng) + " " + _sentence(rng)},
        {"role": "assistant", "content": _sentence(rng)},
    ]
    return Dialogue(messages[rng.randint(0, 1) :])


@functools.cache
def _compiled_template() -> jinja2.Template:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda value: json.dumps(value, ensure_ascii=False)
    return env.from_string(CHAT_TEMPLATE)


def render(dialogue: Dialogue, add_generation_prompt: bool = False) -> str:
    """Render a dialogue with CHAT_TEMPLATE the way transformers does (same `tojson`)."""
    return _compiled_template().render(
        messages=dialogue.messages,
        tools=dialogue.tools,
        add_generation_prompt=add_generation_prompt,
    )


def synthetic_corpus(seed: int, n: int = 3000) -> list[str]:
    """The tokenizer's training text: sentences, arithmetic, JSON and rendered dialogues.

    Deterministic for a seed. Special and tool tokens are cut out: the tokenizer matches
    them before BPE, so the merges should not spend the vocabulary on their spelling.
    """
    rng = random.Random(seed)
    texts: list[str] = []
    for _ in range(n):
        expression, value = _arithmetic(rng)
        tool = rng.choice(list(TOOLS.values()))
        texts += [
            _sentence(rng),
            f"What is {expression}?\n{value}",
            json.dumps({"name": "calculator", "arguments": {"expression": expression}}),
            json.dumps(tool),
            _code(rng),
            render(synthetic_dialogue(rng)),
        ]
    marker = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + TOOL_TOKENS))
    return [piece for text in texts for piece in marker.split(text) if piece]


def build_tokenizer(seed: int) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on `synthetic_corpus(seed)` and wrap it with the template.

    Ids 0..255 are the 256 byte symbols, then the merges, then the special tokens, then the
    tool tokens (VOCAB_SIZE in all). The pipeline (NFC, Qwen2's split, byte level) is the one
    transformers 5 rebuilds for any qwen2 checkpoint in `Qwen2Tokenizer`, so what loads is
    what tokenizer.json says. Deterministic: the trainer's merges depend only on the counts
    and the ids, not on hash seeds or thread count (checked across processes).
    """
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix=""))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS) - len(TOOL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        continuing_subword_prefix="",
        end_of_word_suffix="",
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"vocabulary has {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: "
            "the corpus is too small for the requested merges"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        extra_special_tokens=[IM_START],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int):
        raise TypeError(f"{token!r} is not one token: {token_id!r}")
    return token_id


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen2ForCausalLM:
    """A randomly initialised float32 Qwen2 causal LM sized for `tokenizer` (~1M params).

    The weights depend only on `seed`; the caller's torch RNG state is left as it was.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    im_end, endoftext = _token_id(tokenizer, IM_END), _token_id(tokenizer, ENDOFTEXT)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        max_window_layers=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=im_end,
        pad_token_id=endoftext,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    model.eval()
    return model


def save(out: Path, tokenizer: PreTrainedTokenizerFast, model: Qwen2ForCausalLM) -> None:
    """Write tokenizer, template and model (safetensors) into `out`, creating it."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out, safe_serialization=True)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: build with `--seed` and save into `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()
    sys.stderr.write(f"training tokenizer (seed {args.seed})\n")
    tokenizer = build_tokenizer(args.seed)
    model = build_model(tokenizer, args.seed)
    save(args.out, tokenizer, model)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: vocab {len(tokenizer)}, {params} parameters")  # noqa: T201


if __name__ == "__main__":
    main()
