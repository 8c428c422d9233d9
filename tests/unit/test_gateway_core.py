"""The gateway's domain pieces: what is asked of the engine, kept, returned, counted."""

from __future__ import annotations

import asyncio
import hmac
import time

import orjson
import pytest
from prometheus_client import CollectorRegistry

from harnessrl.episode_token import EpisodeClaims
from harnessrl.http import Request
from harnessrl.services.gateway.admin import Admin
from harnessrl.services.gateway.config import SamplingOverrides
from harnessrl.services.gateway.control import Gate, Paused
from harnessrl.services.gateway.dialects.openai_chat import ChatDialect
from harnessrl.services.gateway.dialects.openai_completions import CompletionsDialect
from harnessrl.services.gateway.dialects.openai_passthrough import Passthrough
from harnessrl.services.gateway.metrics import GatewayMetrics
from harnessrl.services.gateway.open_episodes import EpisodeBook, EpisodeClosedError
from harnessrl.trust.capture import Completion, StreamCapture, take
from harnessrl.trust.contract import CHAT_PATH, COMPLETIONS_PATH, engine_request

CLAIMS = EpisodeClaims("ep", 1, "g", "train", time.time() + 86_400)


def test_the_engine_is_asked_for_ids_and_logprobs_with_the_mode_sampling() -> None:
    body = {"model": "gpt-4o", "messages": [], "temperature": 0.2, "include_reasoning": False}
    upstream = engine_request(
        body, CHAT_PATH, "tiny-model", SamplingOverrides(temperature=1.0, top_p=1.0)
    )
    assert upstream["model"] == "tiny-model"
    assert upstream["return_token_ids"] is True and upstream["logprobs"] is True
    assert upstream["temperature"] == 1.0 and upstream["top_p"] == 1.0
    assert "include_reasoning" not in upstream  # vLLM drops token ids with it
    assert body["temperature"] == 0.2  # the harness's body is left alone
    asked = ChatDialect().translate(body, CLAIMS)
    assert asked.model == "gpt-4o" and asked.renderer == Passthrough("gpt-4o", False, False)
    kept = engine_request(body, CHAT_PATH, "tiny-model", SamplingOverrides())
    assert kept["temperature"] == 0.2
    body = {"model": "m", "prompt": "x", "logprobs": 2}
    completion = engine_request(body, COMPLETIONS_PATH, "m", SamplingOverrides())
    asked = CompletionsDialect().translate(body, CLAIMS)
    assert completion["logprobs"] == 2 and asked.renderer == Passthrough("m", False, True)
    body = {"model": "m", "prompt": "x"}
    completion = engine_request(body, COMPLETIONS_PATH, "m", SamplingOverrides())
    asked = CompletionsDialect().translate(body, CLAIMS)
    assert completion["logprobs"] == 0 and asked.renderer == Passthrough("m", False, False)


def test_train_calls_sample_the_policys_own_distribution() -> None:
    from harnessrl.services.gateway.config import GatewaySection

    body = {"model": "m", "messages": [], "top_k": 5, "logit_bias": {"7": 100}, "seed": 3}
    body |= {"presence_penalty": 1.0, "min_p": 0.1, "repetition_penalty": 1.3, "stop": ["x"]}
    section = GatewaySection()
    train = engine_request(body, CHAT_PATH, "tiny", section.train)
    assert train["temperature"] == 1.0 and train["top_p"] == 1.0
    # Every control vLLM has is sent neutral, so none comes from the model's
    # generation_config.json (Qwen3's top_k 20) when the harness leaves it out.
    neutral = {"top_k": -1, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    neutral |= {"repetition_penalty": 1.0, "min_tokens": 0}
    assert {k: train[k] for k in neutral} == neutral
    for omitted in ({"model": "m", "messages": []}, body):
        sent = engine_request(omitted, CHAT_PATH, "tiny", section.train)
        assert {k: sent[k] for k in neutral} == neutral
    assert "logit_bias" not in train  # no neutral value but absence
    assert train["seed"] == 3 and train["stop"] == ["x"]  # not the distribution: kept
    val = engine_request(body, CHAT_PATH, "tiny", section.val)  # val: the harness's own settings
    assert val["top_k"] == 5 and val["logit_bias"] == {"7": 100}


def test_constrained_decoding_is_told_from_free_sampling() -> None:
    from harnessrl.trust.contract import constrained

    tools = [{"type": "function", "function": {"name": "f"}}]
    assert constrained({"messages": []}) == ""
    assert constrained({"response_format": {"type": "text"}}) == ""
    assert constrained({"response_format": {"type": "json_schema"}}) == "response_format"
    assert constrained({"response_format": {"type": "json_object"}}) == "response_format"
    assert constrained({"guided_json": {"type": "object"}}) == "guided_decoding"
    assert constrained({"structured_outputs": {"regex": "a+"}}) == "guided_decoding"
    assert constrained({"tools": tools, "tool_choice": "auto"}) == ""
    assert constrained({"tools": tools, "tool_choice": "required"}) == "tool_choice"
    forced = {"type": "function", "function": {"name": "f"}}
    assert constrained({"tools": tools, "tool_choice": forced}) == "tool_choice"


def test_stream_chunks_fold_into_per_choice_completions() -> None:
    completions: dict[int, Completion] = {}
    take(
        {
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        chat=True,
        completions=completions,
    )
    for token, lp in ((7, -0.5), (8, -1.5)):
        take(
            {
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": "x"},
                        "token_ids": [token],
                        "logprobs": {"content": [{"token": "x", "logprob": lp}]},
                    }
                ]
            },
            chat=True,
            completions=completions,
        )
    take(
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {},
                    "finish_reason": "stop",
                    "token_ids": [9],
                    "logprobs": {"content": [{"token": "", "logprob": -0.1}]},
                }
            ]
        },
        chat=True,
        completions=completions,
    )
    assert completions[0] == Completion([1, 2, 3], [7, 8, 9], [-0.5, -1.5, -0.1], "stop")


def _chunk(token: int) -> bytes:
    return orjson.dumps(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "x",
                    "token_ids": [token],
                    "logprobs": {"token_logprobs": [-1.0]},
                }
            ]
        }
    )


def test_only_a_stream_that_ran_to_its_done_without_an_error_is_captured() -> None:
    whole = StreamCapture(chat=False)
    assert whole.event(_chunk(5)) is not None and not whole.finished  # not over yet
    assert whole.event(b"[DONE]") is None
    assert whole.finished and whole.completions[0].ids == [5]
    with pytest.raises(ValueError, match="over"):
        whole.event(_chunk(6))  # nothing after the end is folded in
    failed = StreamCapture(chat=False)
    failed.event(_chunk(5))
    assert failed.event(b'{"error": {"message": "generation failed"}}') is not None
    assert failed.failed and not failed.finished
    with pytest.raises(ValueError):
        failed.event(b"[DONE]")  # a [DONE] after an error does not make it whole
    cut = StreamCapture(chat=False)
    cut.event(_chunk(5))
    assert not cut.finished  # the engine's stream ended without [DONE]


def test_completions_fold_per_choice_prompts() -> None:
    completions: dict[int, Completion] = {}
    take(
        {
            "choices": [
                {
                    "index": 0,
                    "text": "a",
                    "prompt_token_ids": [1],
                    "token_ids": [5],
                    "logprobs": {"token_logprobs": [-0.2]},
                    "finish_reason": "length",
                },
                {
                    "index": 1,
                    "text": "b",
                    "prompt_token_ids": [2, 3],
                    "token_ids": [6],
                    "logprobs": {"token_logprobs": [-0.3]},
                    "finish_reason": "length",
                },
            ]
        },
        chat=False,
        completions=completions,
    )
    assert completions[1] == Completion([2, 3], [6], [-0.3], "length")


def test_the_harness_gets_the_api_answer_without_vllm_fields() -> None:
    asked = ChatDialect().translate({"model": "gpt-4o", "messages": []}, CLAIMS).renderer
    assert isinstance(asked, Passthrough)
    data = {
        "model": "tiny",
        "prompt_token_ids": [1],
        "choices": [
            {
                "index": 0,
                "message": {"content": "hi"},
                "token_ids": [2],
                "stop_reason": None,
                "logprobs": {"content": []},
                "finish_reason": "stop",
            }
        ],
    }
    assert asked.harness(data) == {
        "model": "gpt-4o",
        "choices": [
            {"index": 0, "message": {"content": "hi"}, "logprobs": None, "finish_reason": "stop"}
        ],
    }
    body = {"model": "m", "return_token_ids": True, "logprobs": True}
    asked = ChatDialect().translate(body, CLAIMS).renderer
    assert isinstance(asked, Passthrough)
    kept = asked.harness(
        {
            "prompt_token_ids": [1],
            "choices": [{"index": 0, "token_ids": [2], "logprobs": {"content": []}}],
        }
    )
    assert kept["prompt_token_ids"] == [1] and kept["choices"][0]["token_ids"] == [2]
    assert kept["choices"][0]["logprobs"] == {"content": []}


async def test_closing_waits_for_calls_in_flight_and_their_deliveries() -> None:
    book = EpisodeBook()
    episode = book.begin(CLAIMS)
    delivery: asyncio.Future[object] = asyncio.get_running_loop().create_future()
    episode.keep(delivery)
    assert episode.next_seq() == 0 and episode.next_seq() == 1
    closing = asyncio.create_task(book.close(CLAIMS))
    await asyncio.sleep(0.01)
    with pytest.raises(EpisodeClosedError, match="ep attempt 1 is closed"):
        book.begin(CLAIMS)
    assert not closing.done()  # a call is still in flight
    book.end(episode)
    await asyncio.sleep(0.01)
    assert not closing.done()  # its ModelCall is not acknowledged yet
    delivery.set_result(None)
    closed = await closing
    assert closed.calls == 2 and closed.in_flight == 0


def test_expired_episodes_are_forgotten() -> None:
    book = EpisodeBook()
    book.end(book.begin(EpisodeClaims("old", 1, "g", "val", time.time() - 1)))
    book.end(book.begin(CLAIMS))
    assert book.sweep() == 1
    assert len(book) == 1


async def test_a_paused_gate_holds_then_refuses() -> None:
    gate = Gate(hold_s=0.05, retry_after_s=3)
    gate.pause("swap")
    with pytest.raises(Paused) as info:
        await gate.enter()
    assert info.value.retry_after_s == 3
    waiting = asyncio.create_task(Gate.enter(gate))
    await asyncio.sleep(0.01)
    gate.resume()
    await waiting  # a resume within the hold lets the call through


def test_an_episode_ranks_engines_the_same_way_every_time() -> None:
    from harnessrl.services.gateway.engines import EnginePool

    pool = EnginePool([f"http://e{i}:8100" for i in range(4)], timeout_s=1, attempts=2)
    first = {pool.ranking(f"ep-{i}")[0] for i in range(200)}
    assert first == {0, 1, 2, 3}  # spread over all engines
    assert all(pool.ranking("ep-7") == pool.ranking("ep-7") for _ in range(3))


def test_an_engine_version_is_its_highest_successful_load_and_snapshots_stay_put() -> None:
    from harnessrl.services.gateway.versions import EngineVersions
    from harnessrl.v1 import events_pb2 as pb

    versions = EngineVersions()
    assert versions.loaded(pb.PolicyLoaded(version=2, engine="http://vllm:8100/", ok=True))
    sent = versions.snapshot()  # what a call holds while it is in flight
    assert not versions.loaded(pb.PolicyLoaded(version=3, engine="http://vllm:8100", ok=False))
    assert versions.loaded(pb.PolicyLoaded(version=4, engine="http://vllm:8100", ok=True))
    assert not versions.loaded(pb.PolicyLoaded(version=1, engine="http://vllm:8100", ok=True))
    assert dict(sent) == {"http://vllm:8100": 2}
    assert dict(versions.snapshot()) == {"http://vllm:8100": 4}


async def test_the_admin_token_is_compared_in_constant_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compared: list[bytes] = []
    real = hmac.compare_digest

    def spy(given: bytes, expected: bytes) -> bool:
        compared.append(expected)
        return real(given, expected)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    admin = Admin(
        token=b"admin-token-0123456789",
        book=EpisodeBook(),
        gate=Gate(hold_s=0, retry_after_s=1),
        producer=None,  # type: ignore[arg-type]  # status and refusals publish nothing
        metrics=GatewayMetrics(CollectorRegistry()),
        status=dict,
    )

    def status(authorization: str) -> Request:
        headers = {"authorization": authorization}
        return Request("GET", "/admin/status", "", headers, [], b"", None, "1.1", asyncio.Event())

    wrong = await admin.handle(status("Bearer admin-token-0123456788"))
    right = await admin.handle(status("Bearer admin-token-0123456789"))
    assert (wrong.status, right.status) == (401, 200)
    assert compared == [b"Bearer admin-token-0123456789"] * 2
