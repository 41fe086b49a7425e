"""OpenTelemetry traces, one per request across the router and its workers. Torch-free.

Off unless the standard variables name an endpoint (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SDK_DISABLED=true` turns it off again): then each
process that serves (a router, a worker) exports its spans over OTLP/HTTP with the official SDK,
configured by the other `OTEL_*` variables as the SDK reads them (`OTEL_SERVICE_NAME`, ...).
Off, `span` is a shared no-op context manager and nothing of OpenTelemetry is imported.

A request's trace context crosses process boundaries inside its typed record
(`WorkerRequest.traceparent`, W3C `traceparent` text), so a worker's spans join the router's
trace; the router continues the client's own `traceparent` header.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
_NOOP = contextlib.nullcontext()


class Tracing:
    """The process's tracer (`tracing()`), or none (every method then does nothing)."""

    def __init__(self, provider: Any | None) -> None:
        """`provider`: an SDK `TracerProvider` (None: off)."""
        self.provider = provider
        self._tracer = provider.get_tracer("cleave") if provider is not None else None

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def span(self, name: str, traceparent: str | None = None,
             attributes: Mapping[str, Any] | None = None) -> contextlib.AbstractContextManager:
        """A span named `name` (the current one's child, or `traceparent`'s when given),
        current while the `with` block runs."""
        if self._tracer is None:
            return _NOOP
        return self._span(name, traceparent, attributes)

    @contextlib.contextmanager
    def _span(self, name: str, traceparent: str | None,
              attributes: Mapping[str, Any] | None) -> Iterator[Any]:
        assert self._tracer is not None  # checked by `span`
        context = _extract(traceparent) if traceparent else None
        with self._tracer.start_as_current_span(name, context=context,
                                                attributes=dict(attributes or {})) as span:
            yield span

    def record(self, name: str, traceparent: str | None, start_ns: int, end_ns: int,
               attributes: Mapping[str, Any] | None = None) -> None:
        """A span already over (`time.time_ns()` bounds), `traceparent`'s child: for what is
        timed across awaits that a `with` block cannot hold (a stream, a first step)."""
        if self._tracer is None:
            return
        context = _extract(traceparent) if traceparent else None
        span = self._tracer.start_span(name, context=context, start_time=start_ns,
                                       attributes=dict(attributes or {}))
        span.end(end_time=end_ns)

    def traceparent(self) -> str | None:
        """The current span's context as W3C `traceparent` text (None: off, or no span)."""
        if self._tracer is None:
            return None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
        return carrier.get("traceparent")

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        """Add `attributes` to the current span."""
        if self._tracer is not None:
            from opentelemetry import trace

            trace.get_current_span().set_attributes(dict(attributes))


def _extract(traceparent: str) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def from_env(environ: Mapping[str, str] = os.environ) -> Tracing:
    """Tracing as the `OTEL_*` variables ask: OTLP/HTTP to their endpoint, or off."""
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true" or \
            not any(environ.get(k) for k in _ENDPOINTS):
        return Tracing(None)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", "cleave")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return Tracing(provider)


_process: Tracing | None = None


def tracing() -> Tracing:
    """This process's tracing, made from the environment on first use."""
    global _process
    if _process is None:
        _process = from_env()
    return _process


def set_tracing(value: Tracing | None) -> None:
    """Replace this process's tracing (None: made from the environment again on next use);
    tests and embedders that configure their own provider."""
    global _process
    _process = value
