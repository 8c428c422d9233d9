"""Kafka client settings (TLS, SASL) and topic creation, shared by producer, consumer, admin."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from harnessrl import events
from harnessrl.config import KafkaSettings
from harnessrl.logs import get_logger
from harnessrl.retry import Backoff, is_retryable, retry

log = get_logger(__name__)

_TOPIC_ALREADY_EXISTS = 36


class TopicError(RuntimeError):
    """The broker refused to create a topic; the message names the topic and the reason."""


def client_kwargs(settings: KafkaSettings, client_id: str) -> dict[str, Any]:
    """Keyword arguments common to aiokafka's producer, consumer and admin client."""
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.bootstrap_servers,
        "client_id": client_id,
        "request_timeout_ms": settings.request_timeout_ms,
        "security_protocol": settings.security_protocol,
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        context = create_ssl_context(
            cafile=str(settings.ssl_cafile) if settings.ssl_cafile else None,
            certfile=str(settings.ssl_certfile) if settings.ssl_certfile else None,
            keyfile=str(settings.ssl_keyfile) if settings.ssl_keyfile else None,
        )
        context.check_hostname = settings.ssl_check_hostname
        kwargs["ssl_context"] = context
    if settings.security_protocol.startswith("SASL"):
        if not settings.sasl_mechanism or not settings.sasl_username:
            raise ValueError("kafka.sasl_mechanism and kafka.sasl_username: required for SASL")
        kwargs["sasl_mechanism"] = settings.sasl_mechanism
        kwargs["sasl_plain_username"] = settings.sasl_username
        password = settings.sasl_password
        kwargs["sasl_plain_password"] = password.get_secret_value() if password else ""
    return kwargs


async def start_client(make: Callable[[], Any], backoff: Backoff, *, who: str, waiting: str) -> Any:
    """Start a client built by `make()`, waiting out an unreachable broker with `backoff`.

    Each attempt uses a fresh client (a failed aiokafka client cannot be restarted). Raises
    the first non-retryable error; cancelled with the caller.
    """
    delays = backoff.delays()
    while True:
        client = make()
        try:
            await client.start()
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.gather(client.stop(), return_exceptions=True))
            raise
        except Exception as err:
            await asyncio.gather(client.stop(), return_exceptions=True)
            if not is_retryable(err):
                raise
            log.warning(f"broker unreachable; {waiting}", client=who, error=repr(err))
            await asyncio.sleep(next(delays))
            continue
        return client


async def ensure_topics(
    settings: KafkaSettings,
    names: Iterable[str] | None = None,
    *,
    client_id: str = "harnessrl-admin",
    max_attempts: int = 20,
) -> list[str]:
    """Create the missing topics among `names` (default: all of events.TOPICS).

    Idempotent; existing topics are left as they are. Waits for an unreachable broker with
    backoff (`max_attempts` tries). Returns the names it created. Raises TopicError when the
    broker refuses a topic.
    """
    wanted = list(names or events.TOPICS)

    async def attempt() -> list[str]:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        admin = AIOKafkaAdminClient(**client_kwargs(settings, client_id))
        await admin.start()
        try:
            existing = set(await admin.list_topics())
            missing = [n for n in wanted if n not in existing]
            if not missing:
                return []
            new = [
                NewTopic(
                    name,
                    1 if events.TOPICS.get(name, _PLAIN).single_partition else settings.partitions,
                    settings.replication_factor,
                )
                for name in missing
            ]
            response = await admin.create_topics(new)
            for topic, code, message in response.topic_errors:
                if code not in (0, _TOPIC_ALREADY_EXISTS):
                    raise TopicError(f"creating topic {topic}: {message or 'error'} (code {code})")
            log.info("topics created", topics=missing, partitions=settings.partitions)
            return missing
        finally:
            await admin.close()

    return await retry(attempt, backoff=Backoff(0.2, 2.0), max_attempts=max_attempts)


_PLAIN = events.TopicSpec("", None)
