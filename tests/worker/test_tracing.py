"""Request traces' pieces (worker/tracing.py): the endpoint from the config or the standard variables, the config's
errors naming the field, the wire's ``trace`` field checked like every other, and a worker's spans ending exactly
when its requests are gone, exported to a real OTLP/HTTP receiver."""

from __future__ import annotations

import pytest

from benchmarks.otlp_receiver import OtlpReceiver
from cluster.config import ConfigError, parse_config
from engine.request import FinishReason, SamplingParams
from worker.messages import (
    Abort,
    ErrorCode,
    ErrorEvent,
    MalformedMessage,
    Prefill,
    Reserve,
    Reserved,
    TokenItem,
    Tokens,
    decode_command,
    encode,
)
from worker.tracing import RequestSpans, Tracing, TracingOptions, traces_endpoint

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("configured", "environ", "expected"),
    [
        (None, {}, None),
        ("http://collector:4318", {}, "http://collector:4318/v1/traces"),
        ("http://collector:4318/", {}, "http://collector:4318/v1/traces"),
        ("http://collector:4318/custom/path", {}, "http://collector:4318/custom/path"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, "http://c:4318/v1/traces"),
        (
            None,
            {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:9/t", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"},
            "http://c:9/t",
        ),
        ("http://mine:4318", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "http://mine:4318/v1/traces"),
    ],
)
def test_the_traces_endpoint_comes_from_the_config_else_the_standard_variables(configured, environ, expected):
    assert traces_endpoint(configured, environ) == expected


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"otlp_endpoint": "grpc://collector:4317"}, "otlp_endpoint"),
        ({"otlp_endpoint": "http://c:4318", "sample_ratio": 1.5}, "sample_ratio"),
        ({"otlp_endpont": "http://c:4318"}, "otlp_endpont"),
    ],
)
def test_config_errors_name_the_field(section, field):
    with pytest.raises(ConfigError, match=field):
        parse_config({"observability": section})


def test_the_config_gives_every_worker_the_resolved_endpoint(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    config = parse_config({"observability": {"sample_ratio": 0.25, "otlp_headers": {"x-key": "k"}}})
    assert config.runtime_options(["tcp://127.0.0.1:1"], "127.0.0.1").tracing == TracingOptions(
        "http://127.0.0.1:4318/v1/traces", 0.25, "pdserve", {"x-key": "k"}
    )
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert parse_config({}).runtime_options(["tcp://127.0.0.1:1"], "127.0.0.1").tracing is None


@pytest.mark.parametrize("trace", ["00-abc-def-01", PARENT + "x", PARENT.upper(), "x" * 10_000])
def test_a_malformed_trace_field_is_refused_like_any_bad_field(trace):
    command = Abort("r1", trace=trace)
    with pytest.raises(MalformedMessage, match="trace"):
        decode_command(encode(command))
    assert decode_command(encode(Abort("r1", trace=PARENT))).trace == PARENT


def test_a_workers_spans_end_when_its_requests_are_gone_and_reach_the_collector():
    receiver = OtlpReceiver()
    tracing = Tracing(TracingOptions(receiver.endpoint + "/v1/traces"), "decode-0")
    spans = RequestSpans(tracing, "decode-0", "decode")
    try:
        params = SamplingParams(max_tokens=4)
        spans.on_command(Reserve("a", [1, 2, 3], params, trace=PARENT))
        spans.on_command(Reserve("b", [1, 2], params, trace=PARENT))
        spans.on_command(Reserve("untraced", [1], params))  # the router did not sample it: nothing made
        spans.on_command(Prefill("a", [1], params, kv_address="x", dst_blocks=[0], trace=PARENT))  # one span per rid
        spans.on_event(Reserved(worker="decode-0", rid="a", ok=True, blocks=[3, 4]))
        spans.on_event(Tokens(worker="decode-0", items=[TokenItem("a", [7], "x"), TokenItem("a", [8], "y")]))
        spans.on_event(Tokens(worker="decode-0", items=[TokenItem("a", [9], "z", FinishReason.LENGTH)]))
        spans.on_event(ErrorEvent(worker="decode-0", rid="b", message="lost", code=ErrorCode.KV_TRANSFER_FAILED))
        assert set(spans.held) == {"a", "b"}
        spans.prune({"a"})  # b is gone from the engine: its span ends, a's goes on
        assert set(spans.held) == {"a"}
        spans.prune(())
        assert not spans.held
    finally:
        tracing.close()  # exports what is buffered
        received = {s.name + ":" + str(s.attributes["pdserve.request.wire_id"]): s for s in receiver.spans}
        receiver.close()
    a, b = received["pdserve.decode:a"], received["pdserve.decode:b"]
    assert len(received) == 2 and a.trace_id == b.trace_id == PARENT.split("-")[1]
    assert [name for name, _ in a.events] == ["reserved", "first_token", "tokens", "tokens"]
    assert a.attributes["pdserve.finish_reason"] == "length" and a.attributes["pdserve.steps"] == 2
    assert b.status_code == 2 and b.event("error") == {"error.code": "kv_transfer_failed", "error.message": "lost"}
