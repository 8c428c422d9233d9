"""Asking the engine for a policy version by model name, through its real HTTP API and the
real `openai` SDK, during a canary rollout (production.canary.enabled): `<served name>@v<N>`
is served by version N (the x-policy-version header says so) and listed, the served name by
the newest version served, and a version not served is a 404 in OpenAI's shape naming the
model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
import torch
from openai.types.chat import ChatCompletionMessageParam
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from harnessrl.production import ProductionSection
from harnessrl.rollout import CanarySection
from harnessrl.runtime import Runtime
from harnessrl.services.inference.config import InferenceConfig, InferenceSection
from harnessrl.services.inference.service import InferenceService
from harnessrl.v1 import weights_pb2 as pb
from tests.model_helpers import TINY

pytestmark = pytest.mark.integration

SPEC = pb.LoraAdapter(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


def _adapter(model: Any, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rpartition(".")[2] in SPEC.target_modules:
            prefix = f"base_model.model.{path}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                SPEC.rank, module.in_features, generator=generator
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                module.out_features, SPEC.rank, generator=generator
            )
    return tensors


@pytest_asyncio.fixture
async def served() -> AsyncIterator[tuple[str, InferenceService]]:
    """An engine serving version 0 (its base) and the adapter version 1 beside it."""
    config = InferenceConfig(
        inference=InferenceSection(model=TINY, port=0, follow_policy=False, max_model_len=512),
        production=ProductionSection(canary=CanarySection(enabled=True)),
    )
    runtime = Runtime("inference", "test", CollectorRegistry(), TracerProvider())
    service = InferenceService(config, runtime)
    task = asyncio.create_task(service.run())
    await asyncio.wait_for(service.ready.wait(), 60)
    assert service.engine is not None
    await service.engine.add(1, _adapter(service.engine.model, seed=1), SPEC)
    try:
        yield f"http://127.0.0.1:{service.port}/v1", service
    finally:
        await service.stop()
        await task


async def test_each_served_version_is_listed_and_asked_for_by_its_name(
    served: tuple[str, InferenceService],
) -> None:
    url, _ = served
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    listed = [m.id for m in (await client.models.list()).data]
    assert listed == ["tiny-model", "tiny-model@v0", "tiny-model@v1"]
    for model, version in (("tiny-model@v0", "0"), ("tiny-model@v1", "1"), ("tiny-model", "1")):
        response = await client.chat.completions.with_raw_response.create(
            model=model,
            messages=QUESTION,
            max_tokens=3,
            temperature=0,
        )
        assert response.headers["x-policy-version"] == version, model
        assert response.parse().model == model
    async with httpx.AsyncClient() as http:
        async with http.stream(
            "POST",
            f"{url}/completions",
            json={"model": "tiny-model@v0", "prompt": "x", "max_tokens": 2, "stream": True},
        ) as stream:
            assert stream.headers["x-policy-version"] == "0"
        tokenized = await http.post(
            url.removesuffix("/v1") + "/tokenize", json={"model": "tiny-model@v1", "prompt": "x"}
        )
        assert tokenized.status_code == 200


async def test_the_versions_answer_differently(served: tuple[str, InferenceService]) -> None:
    url, _ = served
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    answers = []
    for model in ("tiny-model@v0", "tiny-model@v1"):
        completion = await client.completions.create(
            model=model, prompt="The answer is", max_tokens=8, temperature=0, logprobs=1
        )
        assert completion.choices[0].logprobs is not None
        answers.append(completion.choices[0].logprobs.token_logprobs)
    assert answers[0] != answers[1]


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ("tiny-model@v7", "model: version 7 is not served here"),
        ("other-model@v1", "The model `other-model@v1` does not exist."),
        ("tiny-model@vX", "The model `tiny-model@vX` does not exist."),
    ],
)
async def test_a_version_not_served_is_a_404_naming_the_model(
    served: tuple[str, InferenceService], model: str, says: str
) -> None:
    url, _ = served
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
    body: Any = raised.value.body
    assert body["message"] == says
    assert (body["param"], body["code"], body["type"]) == (
        "model",
        "model_not_found",
        "not_found_error",
    )


async def test_a_removed_version_is_no_longer_listed_nor_served(
    served: tuple[str, InferenceService],
) -> None:
    url, service = served
    assert service.engine is not None
    await service.engine.remove(0)
    async with httpx.AsyncClient() as http:
        listed = (await http.get(f"{url}/models")).json()["data"]
        assert [m["id"] for m in listed] == ["tiny-model", "tiny-model@v1"]
        missing = await http.post(
            f"{url}/chat/completions",
            json={"model": "tiny-model@v0", "messages": QUESTION, "max_tokens": 2},
        )
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "model: version 0 is not served here"
