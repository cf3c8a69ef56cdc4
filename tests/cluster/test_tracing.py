"""One OpenTelemetry trace per request, as an operator's collector receives it (worker/tracing.py): an in-process
cluster exports over OTLP/HTTP to a real receiver in this test, which decodes the protobuf. The client's W3C
``traceparent`` is continued; the router's, prefill's, transfer's and decode's spans hang under one another; a failed
transfer and a move are span events with their codes; with tracing off nothing is made and nothing is sent."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from benchmarks.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.cluster.test_reliability import _drop_layer, _worker
from tests.helpers.cluster import wait_until

pytestmark = pytest.mark.timeout(240)

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def receiver(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the batch processor's export period (ms): tests wait less
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


def _complete(handle, max_tokens: int = 6, headers: dict | None = None, **extra) -> httpx.Response:
    body = {
        "model": handle.config.served_model_name,
        "prompt": "the quick brown fox jumps over the lazy dog",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{handle.base_url}/v1/completions", json=body, headers=headers or {}, timeout=60)


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    named = [s for s in spans if s.name == name]
    assert len(named) == 1, f"{name}: {len(named)} spans among {sorted(s.name for s in spans)}"
    return named[0]


def _has(*names: str):
    return lambda spans: all(any(s.name == n for s in spans) for n in names)


def test_a_disaggregated_request_is_one_trace_across_router_prefill_transfer_and_decode(serve, receiver):
    handle = serve(observability={"otlp_endpoint": receiver.endpoint})
    response = _complete(handle, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200, response.text
    names = ("POST /v1/completions", "pdserve.route", "pdserve.prefill", "pdserve.kv_transfer", "pdserve.decode")
    spans = receiver.wait_for(_has(*names, "pdserve.kv_import"))
    http, route = _one(spans, "POST /v1/completions"), _one(spans, "pdserve.route")
    prefill, transfer = _one(spans, "pdserve.prefill"), _one(spans, "pdserve.kv_transfer")
    decode, kv_import = _one(spans, "pdserve.decode"), _one(spans, "pdserve.kv_import")
    assert {s.trace_id for s in spans} == {CLIENT_TRACE}  # the client's trace, continued everywhere
    assert http.parent_span_id == CLIENT_SPAN and route.parent_span_id == http.span_id
    assert prefill.parent_span_id == route.span_id and decode.parent_span_id == route.span_id
    assert transfer.parent_span_id == prefill.span_id and kv_import.parent_span_id == decode.span_id
    assert http.attributes["http.response.status_code"] == 200
    assert route.attributes["pdserve.worker.prefill"] == "prefill-0"
    assert route.attributes["pdserve.worker.decode"] == "decode-0"
    assert route.attributes["pdserve.status"] == "done" and route.attributes["pdserve.output_tokens"] == 6
    assert route.event("dispatched") is not None and route.event("first_token") is not None
    assert "pdserve.timing.ttft_s" in route.attributes and "pdserve.timing.prefill_compute_s" in route.attributes
    assert prefill.event("first_token") is not None and "pdserve.timing.prefill_queue_s" in prefill.attributes
    assert transfer.attributes["pdserve.kv.ok"] is True and transfer.attributes["pdserve.kv.bytes"] > 0
    assert transfer.attributes["pdserve.kv.paths"]  # how the KV went (zmq, shm-direct, ...)
    layers = [attrs for name, attrs in prefill.events if name == "kv.layer_sent"]  # streamed as each layer was done
    assert len(layers) == transfer.attributes["pdserve.kv.pieces"] >= 1
    assert sum(a["pdserve.kv.bytes"] for a in layers) == transfer.attributes["pdserve.kv.bytes"]
    assert decode.event("reserved") is not None and decode.event("start") is not None
    assert decode.attributes["pdserve.finish_reason"] == "length" and decode.attributes["pdserve.steps"] >= 1
    assert "pdserve.timing.kv_transfer_s" in decode.attributes
    assert {s.resource["service.name"] for s in spans} == {"pdserve"}
    assert {s.resource["pdserve.component"] for s in spans} == {"router-0", "prefill-0", "decode-0"}
    for outer, inner in ((http, route), (route, decode)):  # children inside their parents (same host's clock)
        assert outer.start_ns <= inner.start_ns + 5_000_000 and inner.end_ns <= outer.end_ns + 5_000_000
    assert all(s.status_code != 2 for s in spans)


def test_a_colocated_request_and_a_request_without_traceparent_start_their_own_trace(serve, receiver):
    handle = serve(mode="colocated", observability={"otlp_endpoint": receiver.endpoint})
    assert _complete(handle, stream=True).status_code == 200
    spans = receiver.wait_for(_has("POST /v1/completions", "pdserve.route", "pdserve.generate"))
    http, route, generate = (_one(spans, n) for n in ("POST /v1/completions", "pdserve.route", "pdserve.generate"))
    assert http.parent_span_id == "" and len({http.trace_id, route.trace_id, generate.trace_id}) == 1
    assert generate.parent_span_id == route.span_id and route.attributes["pdserve.worker.decode"]
    assert generate.event("first_token") is not None and generate.attributes["pdserve.finish_reason"] == "length"


def test_a_failed_transfer_is_an_error_event_with_its_code(serve, receiver):
    handle = serve(
        transfer={"deadline_s": 3, "failure_policy": "fail"}, observability={"otlp_endpoint": receiver.endpoint}
    )
    _drop_layer(_worker(handle, "prefill"), layer=1)
    response = _complete(handle)
    assert response.status_code >= 400 and "kv_transfer_failed" in response.text
    spans = receiver.wait_for(_has("POST /v1/completions", "pdserve.route", "pdserve.decode", "pdserve.kv_transfer"))
    route, decode = _one(spans, "pdserve.route"), _one(spans, "pdserve.decode")
    assert route.status_code == 2 and route.event("error")["error.code"] == "kv_transfer_failed"
    assert decode.status_code == 2 and decode.event("error")["error.code"] == "kv_transfer_failed"
    assert _one(spans, "POST /v1/completions").attributes["http.response.status_code"] == response.status_code
    assert _one(spans, "pdserve.kv_transfer").attributes["pdserve.kv.ok"] is False


def test_a_move_shows_on_both_decode_workers_spans(serve, receiver):
    pools = {"decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": 160}}
    handle = serve(pools=pools, observability={"otlp_endpoint": receiver.endpoint})
    moved: dict = {}

    def move_once() -> None:  # once it streams from its decode worker
        wait_until(lambda: any(f.decode and f.num_output_tokens > 4 for f in handle.router.flows.values()), 30)
        flow = next(iter(handle.router.flows.values()))
        body = {"request_id": flow.rid}
        moved.update(
            httpx.post(f"{handle.base_url}/admin/migrate", json=body, headers=handle.admin_headers, timeout=30).json()[
                "moving"
            ]
        )

    mover = threading.Thread(target=move_once)
    mover.start()
    response = _complete(handle, max_tokens=120)
    mover.join(30)
    assert response.status_code == 200 and list(moved.values()) == ["moving"], moved
    spans = receiver.wait_for(
        lambda s: len([x for x in s if x.name == "pdserve.decode"]) >= 2 and _has("pdserve.route")(s)
    )
    decodes = [s for s in spans if s.name == "pdserve.decode"]
    source = next(s for s in decodes if s.event("migration.export") is not None)
    target = next(s for s in decodes if "pdserve.migration.context_tokens" in s.attributes)
    assert (
        source.event("migration.frozen") is not None
        and source.attributes["pdserve.worker"] != target.attributes["pdserve.worker"]
    )
    route = _one(spans, "pdserve.route")
    assert (
        route.attributes["pdserve.migrations"] == 1 and source.parent_span_id == target.parent_span_id == route.span_id
    )


def test_tracing_off_makes_no_span_and_sends_nothing(serve, receiver, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    handle = serve()
    assert _complete(handle, headers={"traceparent": TRACEPARENT}).status_code == 200
    assert handle.router.tracing is None and all(r.actor.worker.spans is None for r in handle.workers)
    assert not any(f.trace for f in handle.router.flows.values())
    time.sleep(0.5)
    assert receiver.requests == 0
