"""Kafka client settings for real clusters: TLS and SASL."""

from __future__ import annotations

import ssl

import pytest
from pydantic import SecretStr

from harnessrl.bus import client_kwargs
from harnessrl.config import KafkaSettings


def test_plaintext_has_no_security_arguments() -> None:
    kwargs = client_kwargs(KafkaSettings(bootstrap_servers="k1:9092,k2:9092"), "svc/0")
    assert kwargs["bootstrap_servers"] == "k1:9092,k2:9092"
    assert kwargs["client_id"] == "svc/0"
    assert kwargs["security_protocol"] == "PLAINTEXT"
    assert "ssl_context" not in kwargs
    assert "sasl_mechanism" not in kwargs


def test_sasl_ssl_builds_a_tls_context_and_sasl_credentials() -> None:
    settings = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="harnessrl",
        sasl_password=SecretStr("s3cret"),
        ssl_check_hostname=False,
    )
    kwargs = client_kwargs(settings, "svc/0")
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    assert kwargs["ssl_context"].check_hostname is False
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["sasl_plain_username"] == "harnessrl"
    assert kwargs["sasl_plain_password"] == "s3cret"


def test_sasl_without_credentials_names_the_missing_settings() -> None:
    settings = KafkaSettings(security_protocol="SASL_PLAINTEXT")
    with pytest.raises(ValueError, match=r"kafka\.sasl_mechanism and kafka\.sasl_username"):
        client_kwargs(settings, "svc/0")
