"""The gateway's limits and answers outside any dialect: the JSON depth limit, the completion
budget, the two error shapes, and the model listing."""

from __future__ import annotations

from typing import Any, Literal

import anthropic
import httpx2
import openai
import orjson
import pytest
from anthropic.types import ModelInfo
from anthropic.types.shared import ErrorResponse
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types import ErrorObject, Model
from prometheus_client import CollectorRegistry

from harnessrl.http import ClientResponse
from harnessrl.services.gateway.budget import TEMPLATE_MARGIN, Budget
from harnessrl.services.gateway.depth import check_depth
from harnessrl.services.gateway.errors import (
    ANTHROPIC,
    OPENAI,
    GatewayError,
    render,
    render_engine,
)
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.services.gateway.models import Models
from harnessrl.trust.contract import TOKENIZE_PATH

# -- the JSON depth limit -----------------------------------------------------------------------


def nested(depth: int, path: list[str | int]) -> Any:
    """`depth` containers, each holding the next at `path` (a key: a dict, an index: a list,
    padded with scalars before it); the innermost holds a scalar."""
    node: Any = ["leaf"]
    for key in reversed(path[: depth - 1]):
        node = [*range(key), node] if isinstance(key, int) else {"sibling": 1, key: node}
    return node


def test_a_body_at_the_limit_is_accepted_and_one_level_more_is_refused() -> None:
    body = {"messages": [{"content": [{"type": "text"}]}]}  # 5 levels
    check_depth(body, 5)
    with pytest.raises(GatewayError) as caught:
        check_depth(body, 4)
    err = caught.value
    assert (err.status, err.param) == (400, "messages.0.content.0")
    assert str(err) == "messages.0.content.0: nested more than 4 levels deep"


def test_a_list_body_too_deep_names_its_indexes() -> None:
    with pytest.raises(GatewayError) as caught:
        check_depth([1, [2, [3, [4]]]], 2)
    assert caught.value.param == "1.1"


def test_scalars_do_not_count_as_a_level() -> None:
    check_depth({"a": "x" * 1000, "b": 5, "c": None}, 1)


def test_an_empty_container_beyond_the_limit_is_refused() -> None:
    """`{"a": {}}` nests two containers: beyond a limit of 1, like `{"a": {"b": 1}}`."""
    with pytest.raises(GatewayError) as caught:
        check_depth({"a": {}}, 1)
    assert caught.value.param == "a"
    with pytest.raises(GatewayError):
        check_depth({"a": [1, {"b": []}]}, 3)


KEYS = st.one_of(
    st.integers(0, 3), st.text(min_size=1, max_size=6).filter(lambda k: k != "sibling")
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.lists(KEYS, min_size=40, max_size=40))
def test_the_depth_limit_holds_at_any_depth_and_position(
    depth: int, limit: int, path: list[str | int]
) -> None:
    body = nested(depth, path)
    if depth <= limit:
        check_depth(body, limit)
        return
    with pytest.raises(GatewayError) as caught:
        check_depth(body, limit)
    named = ".".join(map(str, path[:limit]))
    assert (caught.value.status, caught.value.param) == (400, named)
    assert str(caught.value) == f"{named}: nested more than {limit} levels deep"


# -- the completion budget ----------------------------------------------------------------------


class FakePool:
    """Stands in for the HTTP engine pool (services/gateway/engines.py): this is a unit test
    of the budget arithmetic, so an engine's `/tokenize` and `/v1/models` answers are
    written here; the real pool against a real engine is covered by the integration tests."""

    def __init__(self, count: int = 0, *, tokenize: int = 200, context: int = 0) -> None:
        self.count = count
        self.tokenize_status = tokenize
        self.context = context
        self.tokenized: list[dict[str, Any]] = []

    async def request(self, episode_id: str, path: str, body: bytes) -> tuple[str, ClientResponse]:
        assert path == TOKENIZE_PATH
        self.tokenized.append(orjson.loads(body))
        if self.tokenize_status != 200:
            answer = orjson.dumps({"detail": "Not Found"})
            return "http://engine", ClientResponse(self.tokenize_status, {}, answer)
        answer = orjson.dumps({"count": self.count, "max_model_len": self.context})
        return "http://engine", ClientResponse(200, {}, answer)

    async def get(self, path: str) -> ClientResponse:
        assert path == "/v1/models"
        listing = {"object": "list", "data": [{"id": "tiny", "max_model_len": self.context}]}
        return ClientResponse(200, {}, orjson.dumps(listing))


def budget(
    pool: FakePool,
    context: int | None,
    policy: Literal["clamp", "reject"] = "clamp",
) -> tuple[Budget, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    # A stand-in for EnginePool: the two coroutines Budget calls.
    fitted = Budget(pool, policy=policy, context=context, metrics=metrics)  # type: ignore[arg-type]
    return fitted, registry


def clamped(registry: CollectorRegistry) -> float:
    return registry.get_sample_value("harnessrl_gateway_max_tokens_clamped_total") or 0.0


def chat(max_tokens: int | None = None, **more: Any) -> dict[str, Any]:
    request: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "What is 17 + 25?"}],
        "tools": [{"type": "function", "function": {"name": "calc", "parameters": {}}}],
        "chat_template_kwargs": {"enable_thinking": False},
        "temperature": 1.0,
        **more,
    }
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    return request


async def fit(fitted: Budget, upstream: dict[str, Any], *, chat_call: bool = True) -> bytes:
    return await fitted.fit(
        upstream,
        chat=chat_call,
        episode_id="ep",
        budget_field="max_output_tokens",
        prompt_field="input",
    )


async def test_a_call_that_surely_fits_is_not_counted() -> None:
    pool = FakePool(count=10)
    fitted, registry = budget(pool, context=8192)
    upstream = chat(max_tokens=512)
    assert await fit(fitted, upstream) == orjson.dumps(chat(max_tokens=512))
    assert pool.tokenized == []  # no /tokenize round trip
    assert clamped(registry) == 0


async def test_a_budget_over_the_room_left_is_clamped_to_it_and_counted() -> None:
    pool = FakePool(count=300)
    fitted, registry = budget(pool, context=2048)
    upstream = chat(max_tokens=2000, max_completion_tokens=1900)
    encoded = await fit(fitted, upstream)
    assert upstream["max_tokens"] == upstream["max_completion_tokens"] == 2048 - 300
    assert orjson.loads(encoded) == upstream
    assert clamped(registry) == 1
    # The engine counted the prompt as it will render it: messages, tools, template settings.
    [asked] = pool.tokenized
    assert asked == {
        "messages": upstream["messages"],
        "tools": upstream["tools"],
        "chat_template_kwargs": {"enable_thinking": False},
        "model": "tiny",
    }


async def test_a_budget_within_the_room_left_is_kept() -> None:
    pool = FakePool(count=300)
    fitted, registry = budget(pool, context=2048)
    upstream = chat(max_tokens=1500)  # could overflow (body + margin + budget): counted
    assert await fit(fitted, upstream) == orjson.dumps(chat(max_tokens=1500))
    assert len(pool.tokenized) == 1 and clamped(registry) == 0


async def test_a_call_without_a_budget_is_left_to_the_engine() -> None:
    pool = FakePool(count=900)
    fitted, _ = budget(pool, context=1024)
    upstream = chat()
    assert await fit(fitted, upstream) == orjson.dumps(chat())
    assert "max_tokens" not in upstream


async def test_the_reject_policy_refuses_a_budget_over_the_room_naming_the_field() -> None:
    pool = FakePool(count=300)
    fitted, registry = budget(pool, context=2048, policy="reject")
    upstream = chat(max_tokens=2000)
    with pytest.raises(GatewayError) as caught:
        await fit(fitted, upstream)
    err = caught.value
    assert (err.status, err.param, err.code) == (
        400,
        "max_output_tokens",
        "context_length_exceeded",
    )
    message = str(err)
    assert message.startswith("max_output_tokens: 2000 tokens do not fit")
    assert "300" in message and "1748" in message and "2048" in message
    assert upstream["max_tokens"] == 2000 and clamped(registry) == 0


@pytest.mark.parametrize("policy", ["clamp", "reject"])
@pytest.mark.parametrize("prompt", [4096, 5000])
async def test_a_prompt_that_fills_the_context_is_too_long_with_both_numbers(
    policy: Literal["clamp", "reject"], prompt: int
) -> None:
    fitted, _ = budget(FakePool(count=prompt), context=4096, policy=policy)
    long = [{"role": "user", "content": "word " * 1200}]  # 6,000 bytes: could be 5,000 tokens
    with pytest.raises(GatewayError) as caught:
        await fit(fitted, chat(max_tokens=100, messages=long))
    err = caught.value
    assert (err.status, err.param, err.code) == (400, "input", "context_length_exceeded")
    message = str(err)
    assert message.startswith(f"prompt is too long: {prompt} tokens > 4095 maximum")
    assert "4096" in message
    # Anthropic's clients read these words to compact their context: said once, not twice.
    body = ANTHROPIC.body(err.status, message, err.param, err.code)
    assert body["error"]["message"].count("prompt is too long") == 1


async def test_an_engine_without_tokenize_leaves_the_budget_unchanged() -> None:
    pool = FakePool(tokenize=404)
    fitted, registry = budget(pool, context=2048)
    upstream = chat(max_tokens=2000)
    assert await fit(fitted, upstream) == orjson.dumps(chat(max_tokens=2000))
    assert upstream["max_tokens"] == 2000 and len(pool.tokenized) == 1
    assert clamped(registry) == 0


async def test_a_token_id_prompt_is_counted_without_asking_the_engine() -> None:
    pool = FakePool()
    fitted, _ = budget(pool, context=TEMPLATE_MARGIN + 100)
    upstream = {"model": "tiny", "prompt": list(range(60)), "max_tokens": 2000}
    await fit(fitted, upstream, chat_call=False)
    assert upstream["max_tokens"] == TEMPLATE_MARGIN + 100 - 60
    assert pool.tokenized == []


async def test_the_context_is_read_from_the_engines_model_list() -> None:
    pool = FakePool(count=300, context=2048)
    fitted, _ = budget(pool, context=None)
    upstream = chat(max_tokens=2000)
    await fit(fitted, upstream)
    assert upstream["max_tokens"] == 1748
    unknown = FakePool(count=300, context=0)  # an engine that does not say: no limit applied
    fitted, _ = budget(unknown, context=None)
    upstream = chat(max_tokens=100_000)
    await fit(fitted, upstream)
    assert upstream["max_tokens"] == 100_000 and unknown.tokenized == []


# -- errors in two shapes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (409, "conflict_error"),
        (418, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
    ],
)
def test_a_gateway_error_in_openais_shape(status: int, kind: str) -> None:
    err = GatewayError(status, "input.0.role: must be one of user", "input.0.role", code="bad")
    body = OPENAI.body(err.status, str(err), err.param, err.code)
    assert body == {
        "error": {
            "message": "input.0.role: must be one of user",
            "type": kind,
            "param": "input.0.role",
            "code": "bad",
        }
    }
    ErrorObject.model_validate(body["error"])


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
        (529, "overloaded_error"),
    ],
)
def test_a_gateway_error_in_anthropics_shape(status: int, kind: str) -> None:
    err = GatewayError(status, "messages.0.role: bad", "messages.0.role")
    body = ANTHROPIC.body(err.status, str(err), err.param, err.code)
    assert body == {"type": "error", "error": {"type": kind, "message": "messages.0.role: bad"}}
    if kind != "request_too_large":  # Anthropic's API answers 413 so; the SDK's types lack it
        ErrorResponse.model_validate(body)


def test_a_rendered_error_carries_its_status_and_headers() -> None:
    err = GatewayError(429, "paused", headers=[("retry-after", "3")])
    answer = render(OPENAI, err)
    assert answer.status == 429
    assert answer.headers == [("content-type", "application/json"), ("retry-after", "3")]
    assert orjson.loads(answer.body)["error"]["type"] == "rate_limit_error"


def test_an_engine_error_in_openais_shape_is_passed_on() -> None:
    body = {"error": {"message": "bad", "type": "BadRequestError", "param": "n", "code": 400}}
    assert OPENAI.engine(400, body) == (400, body)


def test_vllms_flat_engine_error_is_put_in_openais_shape() -> None:
    flat = {"object": "error", "message": "bad thing", "type": "BadRequestError", "code": 400}
    assert OPENAI.engine(400, flat) == (
        400,
        {"error": {"message": "bad thing", "type": "BadRequestError", "param": None, "code": 400}},
    )
    assert ANTHROPIC.engine(400, flat)[1]["error"] == {
        "type": "invalid_request_error",
        "message": "bad thing",
    }


def test_an_engine_error_that_is_not_json_is_an_api_error_with_its_text() -> None:
    answer = render_engine(OPENAI, 502, b"<html>bad gateway</html>" + b"x" * 1000)
    assert answer.status == 502
    error = orjson.loads(answer.body)["error"]
    assert error["type"] == "api_error"
    assert error["message"].startswith("<html>bad gateway</html>") and len(error["message"]) == 500
    ErrorObject.model_validate(error)
    empty = orjson.loads(render_engine(OPENAI, 503, b"").body)["error"]
    assert empty["message"] == "the engine answered HTTP 503"
    anthropic_answer = render_engine(ANTHROPIC, 502, b"upstream down")
    assert orjson.loads(anthropic_answer.body) == {
        "type": "error",
        "error": {"type": "api_error", "message": "upstream down"},
    }


def test_an_engine_context_length_error_reads_as_prompt_too_long_for_anthropic() -> None:
    message = "This model's maximum context length is 2048 tokens. However, you requested 2100"
    body = {"error": {"message": message, "code": "context_length_exceeded"}}
    assert ANTHROPIC.engine(400, body)[1]["error"]["message"] == "prompt is too long: " + message
    already = {"error": {"message": "prompt is too long: " + message}}
    assert ANTHROPIC.engine(400, already)[1]["error"]["message"] == "prompt is too long: " + message
    assert OPENAI.engine(400, body) == (400, body)  # OpenAI's clients read it as it is


# -- the model listing ----------------------------------------------------------------------------


def models_handler(models: Models, *, anthropic_shape: bool) -> httpx2.MockTransport:
    """The gateway's model routes in miniature: `/v1/models[/{id}]`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        _, _, rest = request.url.path.partition("/v1/models")
        answer = models.answer(rest.removeprefix("/") or None, anthropic=anthropic_shape)
        return httpx2.Response(answer.status, content=answer.body)

    return httpx2.MockTransport(handler)


def test_openai_clients_get_openais_model_list_and_items() -> None:
    models = Models("tiny")
    sdk = openai.OpenAI(
        api_key="sk-test",
        base_url="http://gateway.test/e/token/v1",
        max_retries=0,
        http_client=httpx2.Client(transport=models_handler(models, anthropic_shape=False)),
    )
    assert [(m.id, m.object, m.owned_by) for m in sdk.models.list()] == [
        ("tiny", "model", "harnessrl")
    ]
    assert sdk.models.retrieve("gpt-4o").id == "gpt-4o"  # any name is served
    listing = orjson.loads(models.answer(None, anthropic=False).body)
    assert listing == {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "harnessrl"}],
    }
    Model.model_validate(listing["data"][0])
    Model.model_validate(orjson.loads(models.answer("gpt-4o", anthropic=False).body))
    engines = {"object": "list", "data": [{"id": "tiny", "object": "model", "max_model_len": 4096}]}
    assert orjson.loads(Models("tiny", engines).answer(None, anthropic=False).body) == engines


def test_anthropic_clients_get_anthropics_model_list_and_items() -> None:
    models = Models("tiny")
    sdk = anthropic.Anthropic(
        api_key="sk-test",
        base_url="http://gateway.test/e/token",
        max_retries=0,
        http_client=httpx2.Client(transport=models_handler(models, anthropic_shape=True)),
    )
    page = sdk.models.list()
    assert [(m.id, m.type, m.display_name) for m in page.data] == [("tiny", "model", "tiny")]
    assert (page.has_more, page.first_id, page.last_id) == (False, "tiny", "tiny")
    item = sdk.models.retrieve("claude-sonnet-4-6")
    assert (item.id, item.type, item.display_name) == (
        "claude-sonnet-4-6",
        "model",
        "claude-sonnet-4-6",
    )
    assert orjson.loads(models.answer(None, anthropic=True).body) == {
        "data": [
            {
                "type": "model",
                "id": "tiny",
                "display_name": "tiny",
                "created_at": "1970-01-01T00:00:00Z",
                "lifecycle": "active",
            }
        ],
        "has_more": False,
        "first_id": "tiny",
        "last_id": "tiny",
    }


def test_anthropic_model_items_are_valid_by_the_sdks_own_model() -> None:
    models = Models("tiny")
    listing = orjson.loads(models.answer(None, anthropic=True).body)
    ModelInfo.model_validate(listing["data"][0])
    ModelInfo.model_validate(orjson.loads(models.answer("claude-x", anthropic=True).body))


@pytest.mark.parametrize("anthropic_shape", [False, True])
def test_a_model_name_over_256_characters_is_not_found(anthropic_shape: bool) -> None:
    models = Models("tiny")
    assert models.answer("m" * 256, anthropic=anthropic_shape).status == 200
    for name in ("m" * 257, ""):
        with pytest.raises(GatewayError) as caught:
            models.answer(name, anthropic=anthropic_shape)
        assert (caught.value.status, caught.value.param) == (404, "model")
