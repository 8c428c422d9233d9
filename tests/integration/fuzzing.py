"""Schema-based fuzzing: every operation of a served OpenAPI document, with schemathesis.

Schemathesis generates requests from the schema, both valid ones (positive) and ones that
break it (negative); each is sent over real HTTP and checked: no 5xx, status code, content
type and body as the schema declares them (so an error body must be the error shape the
schema gives, which each test also checks itself with `error_shape`). Hypothesis drives the
generation with a fixed example budget per operation and mode, so a run has a bounded cost.
Blocking (requests), so the tests run it in a thread while the servers run on their loop.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

STREAM_EVENTS = 10_000
"""Events read from a streamed answer before the client stops reading (schemathesis's
default, 20, cuts most streams short: a harness that went away, which captures nothing)."""
CHECKS = [
    negative_data_rejection,
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
Prepare = Callable[[Any, bool], None]
"""Adjusts a generated case before it is sent: (case, a generated coin flip)."""
ErrorShape = Callable[[str, Any], None]
"""Asserts that an error body (parsed JSON) is the route's own error shape: (path, body)."""


def fuzz(
    schema_url: str,
    base_url: str,
    *,
    examples: int,
    error_shape: ErrorShape,
    headers: dict[str, str] | None = None,
    prepare: Prepare | None = None,
) -> Counter[str]:
    """Fuzz every operation of the schema at `schema_url`, `examples` requests per operation
    and generation mode; returns how many requests got each "METHOD path status" (a status
    ending "-cut": a stream the client stopped reading before its end, which is no answer)."""
    config = SchemathesisConfig.from_dict({"max-stream-events": STREAM_EVENTS})
    schema = schemathesis.openapi.from_url(schema_url, config=config)
    seen: Counter[str] = Counter()
    session = requests.Session()
    for result in schema.get_all_operations():
        operation = result.ok()
        # Negative: what it breaks is the body, when there is one (a path parameter that is
        # any string, such as a stored response's id, has no value that breaks its schema).
        modes = [GenerationMode.POSITIVE, *([GenerationMode.NEGATIVE] if operation.body else [])]
        for mode in modes:
            _fuzz_operation(
                operation, mode, base_url, session, examples, error_shape, headers, prepare, seen
            )
    return seen


def _fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    base_url: str,
    session: requests.Session,
    examples: int,
    error_shape: ErrorShape,
    headers: dict[str, str] | None,
    prepare: Prepare | None,
    seen: Counter[str],
) -> None:
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), flip=st.booleans())
    def run(case: Any, flip: bool) -> None:
        if prepare is not None and mode == GenerationMode.POSITIVE:
            prepare(case, flip)  # not negative cases: it could undo what broke the schema
        response = case.call(base_url=base_url, session=session, headers=headers, timeout=60)
        status = str(response.status_code)
        if response.stream_cut_short:
            status += "-cut"  # the client stopped reading a stream: not an answer
        seen[f"{operation.method.upper()} {operation.path} {status}"] += 1
        case.validate_response(response, checks=CHECKS, headers=headers)
        if response.status_code >= 400:
            error_shape(operation.path, response.json())

    run()


def openai_error_shape(_: str, body: Any) -> None:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) >= {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


def anthropic_error_shape(_: str, body: Any) -> None:
    """Anthropic's error: {"type": "error", "error": {"type", "message"}}."""
    assert isinstance(body, dict) and body.get("type") == "error", body
    error = body.get("error")
    assert isinstance(error, dict) and set(error) >= {"type", "message"}, body
    assert isinstance(error["type"], str) and error["type"], body
    assert isinstance(error["message"], str) and error["message"], body


def summary(seen: Counter[str]) -> str:
    """One line per operation and status, for the test log."""
    return "\n".join(f"{count:5d}  {key}" for key, count in sorted(seen.items()))
