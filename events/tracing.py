"""OpenTelemetry tracing, with W3C trace context carried inside events.

One trace per trial: the SDK opens the trial's trace when it first submits it, and every
event that follows from the trial carries the context in its ``trace`` header (``traceparent``,
``tracestate``), so the projector, the scheduler and the workers (other processes) continue the
same trace. Span and attribute names follow the OpenTelemetry messaging conventions
(``messaging.system``, ``messaging.destination.name``, ``messaging.operation.type``,
``messaging.message.id``).

Exporters (``--otel-exporter``): ``none`` (default; no provider is installed, every helper here
returns at once and events carry no trace, so tracing off costs nothing), ``console``,
``otlp`` (the standard OTLP/HTTP exporter, configured by the usual ``OTEL_EXPORTER_OTLP_*``
variables) and ``jsonl:PATH`` (one JSON object per finished span, appended to PATH; several
processes may share the file).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import default_getter, default_setter
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

EXPORTER_ENV = "STAGETREE_OTEL_EXPORTER"
MESSAGING_SYSTEM = "stagetree"

_propagator = TraceContextTextMapPropagator()
_provider: Any = None
_spec = "none"


class JsonlSpanExporter(SpanExporter):
    """Appends each finished span as one JSON line to ``path`` (O_APPEND, one write per span)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for s in spans:
            ctx, parent = s.get_span_context(), s.parent
            lines.append(json.dumps({
                "name": s.name,
                "trace_id": format(ctx.trace_id, "032x"),
                "span_id": format(ctx.span_id, "016x"),
                "parent_id": format(parent.span_id, "016x") if parent is not None else None,
                "kind": s.kind.name,
                "start_ns": s.start_time,
                "end_ns": s.end_time,
                "attributes": dict(s.attributes or {}),
                "links": [{"trace_id": format(li.context.trace_id, "032x"),
                           "span_id": format(li.context.span_id, "016x")}
                          for li in s.links],
                "resource": dict(s.resource.attributes),
            }, sort_keys=True, default=str))
        data = ("\n".join(lines) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def configure(spec: str | None, service_name: str) -> None:
    """Install a tracer provider for ``spec`` (see module doc); ``None`` reads
    ``$STAGETREE_OTEL_EXPORTER`` (default ``none``).

    Raises:
        ValueError: an unknown exporter spec, or a ``jsonl:PATH`` that cannot be written (the
            message names it).
    """
    global _provider, _spec
    spec = spec if spec is not None else os.environ.get(EXPORTER_ENV, "none")
    if spec == "none":
        _spec = spec
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    if spec == "console":
        processor: Any = SimpleSpanProcessor(ConsoleSpanExporter())
    elif spec == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        processor = BatchSpanProcessor(OTLPSpanExporter())
    elif spec.startswith("jsonl:") and len(spec) > len("jsonl:"):
        path = spec[len("jsonl:"):]
        try:  # the file every span is appended to: one that cannot be written lost each span, in a traceback
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError as exc:
            raise ValueError(f"`--otel-exporter` is {spec!r}, but {path!r} cannot be written: "
                             f"{exc.strerror or exc}") from None
        processor = SimpleSpanProcessor(JsonlSpanExporter(path))
    else:
        raise ValueError(f"`--otel-exporter` is {spec!r}, but must be none, console, otlp or jsonl:PATH")
    provider = TracerProvider(resource=Resource.create({"service.name": service_name, "process.pid": os.getpid()}))
    provider.add_span_processor(processor)
    _provider, _spec = provider, spec


def spec() -> str:
    """The exporter spec in force (passed on to child processes)."""
    return _spec


def enabled() -> bool:
    return _provider is not None


def shutdown() -> None:
    """Flush and stop the provider (call before the process exits)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def tracer() -> trace.Tracer:
    if _provider is None:
        return trace.NoOpTracer()
    return _provider.get_tracer("stagetree")


def carrier() -> dict[str, str] | None:
    """The current span's W3C context as an event ``trace`` header (None when not tracing)."""
    if _provider is None:
        return None
    out: dict[str, str] = {}
    _propagator.inject(out, setter=default_setter)
    return out or None


def context_of(header: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context carried by an event's ``trace`` header (None: no header)."""
    if not header:
        return None
    return _propagator.extract(dict(header), getter=default_getter)


def link_to(header: Mapping[str, str] | None) -> Link | None:
    ctx = context_of(header)
    if ctx is None:
        return None
    span_ctx = trace.get_current_span(ctx).get_span_context()
    return Link(span_ctx) if span_ctx.is_valid else None


def messaging(operation: str, destination: str, message_id: str | None = None, **extra: Any) -> dict[str, Any]:
    """Messaging semantic-convention attributes for a span that publishes or processes an event."""
    attrs: dict[str, Any] = {
        "messaging.system": MESSAGING_SYSTEM,
        "messaging.destination.name": destination,
        "messaging.operation.type": operation,
    }
    if message_id:
        attrs["messaging.message.id"] = message_id
    attrs.update({f"stagetree.{k}": v for k, v in extra.items() if v is not None})
    return attrs


@contextmanager
def span(name: str, *, parent: Mapping[str, str] | None = None, new_trace: bool = False,
         kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None,
         links: Sequence[Mapping[str, str] | None] = (), start_time: int | None = None) -> Iterator[Any]:
    """A span, child of the event header ``parent`` when given, else of the current span
    (``new_trace``: a new root); ``start_time`` in epoch nanoseconds when the work began
    earlier. Does nothing at all when tracing is off."""
    if _provider is None:
        yield None
        return
    if new_trace:
        ctx: otel_context.Context | None = otel_context.Context()
    else:
        ctx = context_of(parent)
    real_links = [li for li in (link_to(h) for h in links) if li is not None]
    with tracer().start_as_current_span(name, context=ctx, kind=kind, attributes=dict(attributes or {}),
                                        links=real_links, start_time=start_time) as s:
        yield s
