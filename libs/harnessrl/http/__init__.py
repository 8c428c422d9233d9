"""A lean HTTP/1.1 server and client on asyncio protocols and httptools' C parser.

server = HttpServer(handle, host="0.0.0.0", port=8000, on_error=render_error)
client = HttpClient("http://engine:8000", max_connections=256)

Built for the gateway's hot path: little Python per request, no framework. Runs on uvloop
when the process installed it, on the default loop otherwise.
"""

from harnessrl.http.client import ClientResponse, HttpClient, StreamResponse
from harnessrl.http.errors import (
    ConnectError,
    ConnectionClosedError,
    HttpClientError,
    ProtocolError,
    UpstreamTimeout,
)
from harnessrl.http.messages import (
    ErrorRenderer,
    Handler,
    Request,
    Response,
    StreamingResponse,
    json_error,
)
from harnessrl.http.server import HttpServer
from harnessrl.http.sse import SseDecoder

__all__ = [
    "ClientResponse",
    "ConnectError",
    "ConnectionClosedError",
    "ErrorRenderer",
    "Handler",
    "HttpClient",
    "HttpClientError",
    "HttpServer",
    "ProtocolError",
    "Request",
    "Response",
    "SseDecoder",
    "StreamResponse",
    "StreamingResponse",
    "UpstreamTimeout",
    "json_error",
]
