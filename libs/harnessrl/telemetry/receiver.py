"""A local OTLP/gRPC trace receiver that stores what it gets as OTLP-JSON lines.

`harnessrl up` runs one so traces work with nothing else installed; tests start one to check
real OTLP export. It implements the collector's TraceService, so any OTLP exporter can send
to it.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from harnessrl.telemetry.jsonl import JsonLinesWriter


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, writer: JsonLinesWriter) -> None:
        self._writer = writer

    async def Export(
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._writer.write(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """OTLP/gRPC receiver on `host:port` (port 0 picks one) appending spans to `path`."""

    def __init__(self, path: Path, host: str = "127.0.0.1", port: int = 4317) -> None:
        self.path = path
        self._host = host
        self._port = port
        self._server: grpc.aio.Server | None = None
        self._writer: JsonLinesWriter | None = None

    @property
    def endpoint(self) -> str:
        """The URL an OTLP gRPC exporter should use (valid after start)."""
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        self._writer = JsonLinesWriter(self.path)
        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]  # generated without types
            _TraceService(self._writer), self._server
        )
        self._port = self._server.add_insecure_port(f"{self._host}:{self._port}")
        await self._server.start()

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop serving (idempotent); requests in progress get `grace_s` to finish."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace_s)
        if self._writer is not None:
            self._writer.close()
            self._writer = None
