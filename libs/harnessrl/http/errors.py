"""What the HTTP client raises, classified for `harnessrl.retry.is_retryable`.

- `ConnectError` (a ConnectionError): no connection could be made, so nothing was sent;
  retryable, and safe to retry anywhere.
- `ConnectionClosedError` (a ConnectionError): the upstream closed or reset the connection
  before the response was complete; retryable, but the request may have been processed.
- `UpstreamTimeout` (a TimeoutError): no response bytes for `read_timeout_s`; retryable,
  and the request may have been processed.
- `ProtocolError`: the upstream sent something that is not HTTP/1.1; not retryable.
"""

from __future__ import annotations


class HttpClientError(Exception):
    """Base of every error the HTTP client raises about the upstream."""


class ConnectError(HttpClientError, ConnectionError):
    """The connection could not be made (refused, unreachable, or connect timed out)."""


class ConnectionClosedError(HttpClientError, ConnectionError):
    """The upstream closed or reset the connection before the response was complete."""


class UpstreamTimeout(HttpClientError, TimeoutError):
    """The upstream sent nothing for the read timeout."""


class ProtocolError(HttpClientError):
    """The upstream's bytes are not a valid HTTP/1.1 response."""
