"""Request traces (OpenTelemetry): one trace per request across the router, prefill, KV transfer and decode.

With ``observability.otlp_endpoint`` set (or the standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT``), each process that serves a request records its part as spans of one trace and
exports them in batches over OTLP/HTTP (protobuf) from opentelemetry-sdk's ``BatchSpanProcessor`` thread, off the
request's path. The router's root span continues the client's W3C ``traceparent``; its context crosses to the workers
in the commands' ``trace`` field (a traceparent string, sealed with the rest of the command). A worker keeps one span
per request it holds (``RequestSpans``), fed from the commands it takes and the events it sends; its transfer's end
becomes a child span. Tracing off: the opentelemetry imports below never run and no span is made.

Spans and attributes: docs/observability.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Container, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from worker.messages import (
    Abort,
    Command,
    ErrorEvent,
    Event,
    Export,
    Frozen,
    Generate,
    Prefill,
    Reserve,
    Reserved,
    Resume,
    Start,
    Timing,
    Tokens,
    split_kv_address,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

logger = logging.getLogger(__name__)

# the API call's server span (cluster/openai/api.py's middleware sets it): each choice's route span goes under it
REQUEST_SPAN: ContextVar[Span | None] = ContextVar("pdserve_request_span", default=None)

TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for traces, added to an endpoint given without one
MAX_STEP_EVENTS = 100  # a decode span's per-step events; later steps are counted, not recorded


@dataclass(frozen=True, slots=True)
class TracingOptions:
    """Where and how much to trace (``observability`` in the config; carried to every worker in its spec)."""

    endpoint: str  # the OTLP/HTTP traces URL (http://collector:4318/v1/traces)
    sample_ratio: float = 1.0  # the share of new traces recorded (a client's sampled traceparent is always followed)
    service_name: str = "pdserve"
    headers: dict[str, str] = field(default_factory=dict)  # sent with every export (a collector's API key)
    export_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"observability.sample_ratio must be in [0, 1], got {self.sample_ratio!r}")
        if urlsplit(self.endpoint).scheme not in ("http", "https"):
            raise ValueError(f"observability.otlp_endpoint must be an http(s) URL, got {self.endpoint!r}")


def traces_endpoint(configured: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP/HTTP traces URL: the config's, else the standard variables' (None: tracing off). An endpoint with no
    path gets OTLP's ``/v1/traces``, as ``OTEL_EXPORTER_OTLP_ENDPOINT`` does by the specification."""
    if configured:
        base = configured
    elif environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
    elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return environ["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + TRACES_PATH
    else:
        return None
    return base if urlsplit(base).path not in ("", "/") else base.rstrip("/") + TRACES_PATH


def epoch_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` stamp of this process as epoch nanoseconds (span times are wall-clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def traceparent_of(span: Span) -> str | None:
    """The W3C traceparent naming ``span`` as parent, or None when the span is not sampled (its workers then make
    nothing either)."""
    context = span.get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-01"


class Tracing:
    """One component's tracer (router, or a worker): a tracer provider of its own, never the process-global one, so
    that in-process clusters (tests, ``pdserve demo``) hold several and each closes its own."""

    def __init__(self, options: TracingOptions, component: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        self.options = options
        resource = Resource.create({"service.name": options.service_name, "pdserve.component": component})
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(options.sample_ratio)))
        exporter = OTLPSpanExporter(
            endpoint=options.endpoint, headers=dict(options.headers), timeout=options.export_timeout_s
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("pdserve")

    def start(
        self,
        name: str,
        parent: str | Span | None,
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
        kind: str = "internal",
    ) -> Span:
        """A span under ``parent``: a span of this process, or a W3C traceparent from elsewhere (None or malformed:
        a new trace's root)."""
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if parent is None or isinstance(parent, str):
            context = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
        else:
            context = set_span_in_context(parent)
        return self.tracer.start_span(
            name,
            context=context,
            kind=SpanKind.SERVER if kind == "server" else SpanKind.INTERNAL,
            attributes=dict(attributes or {}),
            start_time=start_ns,
        )

    def child(self, parent: Span, name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any]) -> Span:
        """A finished child span of ``parent`` (times known afterwards: a transfer's, a KV import's)."""
        span = self.start(name, parent, attributes, start_ns)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def close(self) -> None:
        """Export what is buffered (bounded by the export timeout) and stop the exporter's thread."""
        try:
            self.provider.shutdown()
        except Exception:  # noqa: BLE001 - a collector that is gone must not fail a shutdown
            logger.warning("tracing: the last spans were not exported", exc_info=True)


def mark_error(span: Span, code: str, message: str) -> None:
    from opentelemetry.trace import Status, StatusCode

    span.add_event("error", {"error.code": code, "error.message": message[:500]})
    span.set_attribute("error.code", code)
    span.set_status(Status(StatusCode.ERROR, f"{code}: {message[:200]}"))


def timing_attributes(timing: Timing) -> dict[str, float | bool]:
    """A ``Timing``'s set figures as ``pdserve.timing.<field>`` attributes (monotonic stamps left out)."""
    return {f"pdserve.timing.{name}": value for name, value in timing.response().items()}


@dataclass(slots=True)
class _Held:
    span: Span
    steps: int = 0  # tokens events seen
    first_token: bool = False
    kv_imported: bool = False  # its KV import's span was made (timing comes again with the last token)
    pieces: int = 0  # prefill: KV pieces (a layer's range of blocks) handed to the sender
    kv_addresses: tuple[str, ...] = ()  # prefill: the receivers of its KV (each rank's of the decode worker)


class RequestSpans:
    """A worker's span per request it holds, by wire id: started by the request's first command that carries a
    trace, fed from the commands and events that concern it, ended once the engine no longer holds it (``prune``,
    each loop turn: the one place a span ends, whatever way the request went)."""

    def __init__(self, tracing: Tracing, worker: str, role: str) -> None:
        self.tracing, self.worker, self.role = tracing, worker, role
        self.held: dict[str, _Held] = {}

    def on_command(self, command: Command) -> None:
        if isinstance(command, (Reserve, Prefill, Generate)):
            if command.trace is None or command.rid in self.held:
                return
            attributes: dict[str, Any] = {
                "pdserve.worker": self.worker,
                "pdserve.role": self.role,
                "pdserve.request.wire_id": command.rid,
                "pdserve.prompt_tokens": len(command.prompt),
            }
            if isinstance(command, Reserve):
                name = "pdserve.decode"
                if command.context_tokens is not None:  # the target of a move
                    attributes["pdserve.migration.context_tokens"] = command.context_tokens
            elif isinstance(command, Prefill):
                name = "pdserve.prefill"
                attributes["pdserve.kv.cached_tokens"] = command.cached_tokens
                attributes["pdserve.kv.dst_blocks"] = len(command.dst_blocks)
            else:
                name = "pdserve.generate"
            started = self.held[command.rid] = _Held(self.tracing.start(name, command.trace, attributes))
            if isinstance(command, Prefill):
                started.kv_addresses = tuple(split_kv_address(command.kv_address).ranks)
            return
        if not isinstance(command, (Export, Start, Resume, Abort)):
            return
        held = self.held.get(command.rid)
        if held is None:
            return
        if isinstance(command, Export):
            held.span.add_event(
                "migration.export",
                {"pdserve.migration.target_wire_id": command.target_rid, "pdserve.migration.precopy": command.precopy},
            )
        elif isinstance(command, Start):
            held.span.add_event("start", {"pdserve.tokens": len(command.tokens)})
        elif isinstance(command, Resume):
            held.span.add_event("migration.resume")
        elif isinstance(command, Abort):
            held.span.add_event("abort")
            held.span.set_attribute("pdserve.aborted", True)

    def on_event(self, event: Event) -> None:
        if isinstance(event, Tokens):
            for item in event.items:
                held = self.held.get(item.rid)
                if held is None:
                    continue
                span = held.span
                if item.token_ids and not held.first_token:
                    held.first_token = True
                    span.add_event("first_token", {"pdserve.tokens": len(item.token_ids)})
                elif item.token_ids:
                    held.steps += 1
                    if held.steps <= MAX_STEP_EVENTS:
                        span.add_event("tokens", {"pdserve.tokens": len(item.token_ids)})
                if item.timing is not None:
                    span.set_attributes(timing_attributes(item.timing))
                    self.on_kv_import(item.rid, item.timing)
                if item.cached_tokens is not None:
                    span.set_attribute("pdserve.prefix_hit_tokens", item.cached_tokens)
                if item.finish_reason is not None:
                    span.set_attribute("pdserve.finish_reason", item.finish_reason.value)
            return
        rid = event.rid if isinstance(event, (Reserved, ErrorEvent, Frozen)) else None
        held = self.held.get(rid) if rid is not None else None
        if held is None:
            return
        if isinstance(event, Reserved):
            held.span.add_event(
                "reserved" if event.ok else "refused",
                {
                    "pdserve.kv.blocks": len(event.blocks),
                    "pdserve.kv.cached_tokens": event.cached_tokens,
                    "pdserve.prefill_local": event.prefill_local,
                    **({"pdserve.refusal": event.reason} if event.reason else {}),
                },
            )
        elif isinstance(event, ErrorEvent):
            mark_error(held.span, event.code.value, event.message)
        elif isinstance(event, Frozen):
            held.span.add_event("migration.frozen", {"pdserve.tokens": len(event.output_token_ids)})

    def layer_sink(self, rid: str, sink: Callable[[Any], None]) -> Callable[[Any], None]:
        """``sink`` (a prefill's KV sink, engine.kv_connector), with an event per piece it sends: the layer, its
        blocks and bytes, at the moment the layer was done."""
        held = self.held.get(rid)
        if held is None:
            return sink

        def send(ready: Any) -> None:
            sink(ready)
            held.pieces += 1
            held.span.add_event(
                "kv.layer_sent",
                {
                    "pdserve.kv.layer": ready.layer,
                    "pdserve.kv.blocks": ready.end_block - ready.first_block,
                    "pdserve.kv.bytes": ready.k.nbytes + (ready.v.nbytes if ready.v is not None else 0),
                },
            )

        return send

    def on_transfer_end(
        self, rid: str, ok: bool, nbytes: int, elapsed_s: float, error: str | None, paths: Mapping[str, str]
    ) -> None:
        """A prefill request's KV transfer ended (acknowledged, failed, aborted): its child span."""
        held = self.held.get(rid)
        if held is None:
            return
        end_ns = time.time_ns()
        attributes: dict[str, Any] = {
            "pdserve.kv.bytes": nbytes,
            "pdserve.kv.pieces": held.pieces,
            "pdserve.kv.ok": ok,
            # how the payload went to this transfer's receivers (inline, shm-direct, cuda-ipc, pair)
            "pdserve.kv.paths": ",".join(sorted({paths[a] for a in held.kv_addresses if a in paths})),
        }
        span = self.tracing.child(held.span, "pdserve.kv_transfer", end_ns - int(elapsed_s * 1e9), end_ns, attributes)
        if not ok:
            mark_error(span, "kv_transfer_failed", error or "")

    def on_kv_import(self, rid: str, timing: Timing) -> None:
        """A decode request's KV arrived (``kv_done_mono``, ``kv_transfer_s``): its child span, reservation to KV."""
        held = self.held.get(rid)
        if held is None or held.kv_imported or timing.kv_done_mono is None or timing.kv_transfer_s is None:
            return
        held.kv_imported = True
        end_ns = epoch_ns(timing.kv_done_mono)
        self.tracing.child(
            held.span,
            "pdserve.kv_import",
            end_ns - int(timing.kv_transfer_s * 1e9),
            end_ns,
            {"pdserve.timing.kv_transfer_s": timing.kv_transfer_s, "pdserve.kv.recomputed": timing.recomputed},
        )

    def prune(self, held_rids: Container[str]) -> None:
        """End the spans of requests the worker no longer holds."""
        for rid in [rid for rid in self.held if rid not in held_rids]:
            held = self.held.pop(rid)
            if held.steps > MAX_STEP_EVENTS:
                held.span.set_attribute("pdserve.step_events_dropped", held.steps - MAX_STEP_EVENTS)
            held.span.set_attribute("pdserve.steps", held.steps)
            held.span.end()

    def close(self) -> None:
        self.prune(())
