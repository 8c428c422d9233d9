"""The doctor's words for a break: the message and line a difference falls in, and the
verdict helpers."""

from __future__ import annotations

from harnessrl.apps.doctor.causes import explain, locate
from harnessrl.apps.doctor.checks import FAIL, NA, OK, WARN, Check, at_least, at_most, stats, worst


def chars(ids: list[int]) -> str:
    """A decoder where each id is one character."""
    return "".join(map(chr, ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


SYSTEM = "<|im_start|>system\nYou are helpful.\nclient: cli\nx-request-id: {}<|im_end|>\n"
USER = "<|im_start|>user\nfix the bug<|im_end|>\n"


def test_a_changed_system_prompt_line_is_located_by_role_and_line() -> None:
    context = ids(SYSTEM.format("aaaa") + USER + "<|im_start|>assistant\nok<|im_end|>\n")
    prompt = ids(SYSTEM.format("bbbb") + USER)
    position = next(i for i, (a, b) in enumerate(zip(context, prompt, strict=False)) if a != b)
    where = locate(context, prompt, position, chars)
    assert (where.role, where.line) == ("system", 3)
    assert where.sent == "x-request-id: bbbb<|im_end|>"
    assert where.recorded == "x-request-id: aaaa<|im_end|>"
    cause, fix = explain("other", where, temperature_change=False, share=1.0)
    assert cause.startswith("the system prompt changes on every call at line 3: sent `x-re")
    assert "out of the system prompt" in fix


def test_an_edited_tool_result_and_a_template_without_roles() -> None:
    context = ids(SYSTEM.format("a") + "<|im_start|>tool\nline one\nresult 1<|im_end|>\n")
    prompt = ids(SYSTEM.format("a") + "<|im_start|>tool\nline one\nresult 2<|im_end|>\n")
    position = len(context) - len("1<|im_end|>\n")
    where = locate(context, prompt, position, chars)
    assert (where.role, where.line) == ("tool", 2)
    assert explain("other", where, temperature_change=False, share=0.5)[0].startswith(
        "an earlier tool result is rewritten in place at 50% of calls"
    )
    plain = locate(ids("a\nb\nc"), ids("a\nb\nd"), 4, chars)
    assert (plain.role, plain.line) == ("", 3)


def test_verdict_helpers() -> None:
    assert [at_most(v, 0.1, 0.5) for v in (0.1, 0.3, 0.6)] == [OK, WARN, FAIL]
    assert [at_least(v, 0.9, 0.5) for v in (0.95, 0.6, 0.4)] == [OK, WARN, FAIL]

    def check(verdict: str) -> Check:
        return Check("x", "s", "t", verdict, "", "")

    assert worst([check(OK), check(NA), check(WARN)]) == WARN
    assert worst([check(NA)]) == OK and worst([]) == OK
    assert stats([3.0, 1.0, 2.0]) == {
        "n": 3,
        "mean": 2.0,
        "p50": 2.0,
        "p90": 3.0,
        "max": 3.0,
        "min": 1.0,
    }
    assert stats([])["mean"] is None
