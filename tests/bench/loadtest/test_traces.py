"""Reading and fitting public traces (bench/loadtest/traces.py): every format on its real rows (excerpts vendored in
tests/bench/loadtest/traces/), a bad row named by file, line and field, and the fit: window, max rows, time divided
by the speed-up, lengths and the hash-block size scaled together so a prompt still spans exactly its blocks, rows over
the context counted and left out, and the ideal prefix-hit rate of an unbounded cache."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.loadtest.traces import TraceFit, fit_trace, parse_window, read_trace

HERE = Path(__file__).parent / "traces"
MOONCAKE, AZURE = HERE / "mooncake_excerpt.jsonl", HERE / "azure_code_excerpt.csv"


def test_the_mooncake_rows_as_published():
    raw = read_trace("mooncake", MOONCAKE)
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    assert len(raw.rows) == 60 and raw.block_tokens == 512 and raw.skipped == 0
    assert raw.rows[0].input_tokens == first["input_length"] and raw.rows[0].hash_ids == tuple(first["hash_ids"])
    assert raw.rows[0].arrival_s == 0.0 and raw.rows[-1].arrival_s == 15.0  # milliseconds to seconds
    assert all(len(r.hash_ids or ()) == math.ceil(r.input_tokens / 512) for r in raw.rows)


def test_the_azure_rows_as_published():
    raw = read_trace("azure", AZURE)
    assert len(raw.rows) == 60 and raw.block_tokens is None and raw.rows[0].hash_ids is None
    assert (raw.rows[0].input_tokens, raw.rows[0].output_tokens) == (4808, 10)
    assert raw.rows[1].arrival_s == pytest.approx(0.052, abs=1e-6)  # 18:17:04.03196 - 18:17:03.97996


def test_burstgpt_and_pdserves_own_jsonl(tmp_path):
    burst = tmp_path / "burst.csv"
    burst.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n"
        "6,ChatGPT,1087,0,1087,Conversation log\n"  # failed: no response
        "9,GPT-4,417,276,693,API log\n"
    )
    raw = read_trace("burstgpt", burst)
    assert [(r.arrival_s, r.input_tokens, r.output_tokens) for r in raw.rows] == [(0.0, 472, 18), (4.0, 417, 276)]
    assert raw.skipped == 1
    own = tmp_path / "own.jsonl"
    rows = [
        {"arrival_s": 1.5, "input_tokens": 40, "output_tokens": 8, "hash_ids": [1, 2, 3], "block_tokens": 16},
        {"arrival_s": 0.5, "input_tokens": 20, "output_tokens": 4, "hash_ids": [1, 4], "block_tokens": 16},
    ]
    own.write_text("\n".join(json.dumps(r) for r in rows))
    raw = read_trace("trace-jsonl", own)
    assert [(r.arrival_s, r.hash_ids) for r in raw.rows] == [(0.0, (1, 4)), (1.0, (1, 2, 3))] and raw.block_tokens == 16


@pytest.mark.parametrize(
    ("fmt", "text", "message"),
    [
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}',
            "2:.*hash_ids has 1",
        ),
        ("mooncake", '{"timestamp": 0, "input_length": -4, "output_length": 5, "hash_ids": []}', "2:.*input_length"),
        ("mooncake", '{"timestamp": 0, "input_length": 4, "hash_ids": [1]}', "2:.*output_length is missing"),
        ("mooncake", "[1, 2]", "2:.*not a JSON object"),
        ("trace-jsonl", '{"arrival_s": "soon", "input_tokens": 4, "output_tokens": 5}', "2:.*arrival_s"),
        ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:04.1,12.5,3", "2:.*ContextTokens"),
        ("azure", "TIMESTAMP,ContextTokens\n2023-11-16 18:17:04.1,12", "1:.*lacks GeneratedTokens"),
        ("burstgpt", "Timestamp,Model,Request tokens,Response tokens\nnoon,x,1,1", "2:.*Timestamp"),
    ],
)
def test_a_bad_row_is_named_by_file_line_and_field(tmp_path, fmt, text, message):
    path = tmp_path / "trace"
    good = '{"timestamp": 0, "input_length": 4, "output_length": 5, "hash_ids": [9]}'
    if fmt == "trace-jsonl":
        good = '{"arrival_s": 0, "input_tokens": 4, "output_tokens": 5}'
    path.write_text(text if fmt in ("azure", "burstgpt") else good + "\n" + text)
    with pytest.raises(ValueError, match=f"{path}:{message}"):
        read_trace(fmt, path)


def test_the_window_max_rows_and_speedup():
    raw = read_trace("mooncake", MOONCAKE)
    trace = fit_trace(raw, TraceFit(speedup=2.0, window=(3.0, 12.0)))
    inside = [r for r in raw.rows if 3.0 <= r.arrival_s < 12.0]
    assert trace.counts == {"in_window": len(inside), "over_context": 0, "skipped": 0}
    assert trace.rows[0].arrival_s == 0.0  # the window's first row is sent at once
    assert [r.arrival_s for r in trace.rows] == [(r.arrival_s - inside[0].arrival_s) / 2.0 for r in inside]
    assert len(fit_trace(raw, TraceFit(max_rows=7)).rows) == 7
    assert parse_window("600:1200") == (600.0, 1200.0)
    with pytest.raises(ValueError, match="--trace-window"):
        parse_window("600-1200")
    with pytest.raises(ValueError, match="--trace-speedup"):
        TraceFit(speedup=0)


def test_a_token_scale_scales_the_hash_blocks_with_the_lengths():
    raw = read_trace("mooncake", MOONCAKE)
    trace = fit_trace(raw, TraceFit(token_scale=1 / 32))
    assert trace.block_tokens == 16
    for full, scaled in zip(raw.rows, trace.rows):
        assert scaled.hash_ids == full.hash_ids  # the same blocks, shared as before
        blocks = len(full.hash_ids or ())
        assert (blocks - 1) * 16 < scaled.input_tokens <= blocks * 16  # spans exactly its blocks
        assert abs(scaled.input_tokens - full.input_tokens / 32) <= 16
        assert scaled.output_tokens == max(1, round(full.output_tokens / 32))


def test_rows_over_the_context_are_counted_never_cut():
    raw = read_trace("mooncake", MOONCAKE)
    trace = fit_trace(raw, TraceFit(token_scale=1 / 32, max_context_tokens=400))
    over = [r for r in raw.rows if max(1, round(r.output_tokens / 32)) + 1 > 400 or r.input_tokens / 32 > 300]
    assert trace.counts["over_context"] > 0 and len(over) >= 1
    assert len(trace.rows) + trace.counts["over_context"] == 60
    assert all(r.input_tokens + r.output_tokens <= 400 for r in trace.rows)


def test_the_ideal_prefix_hit_rate_counts_shared_leading_blocks():
    raw = read_trace("mooncake", MOONCAKE)
    trace = fit_trace(raw, TraceFit(max_rows=3))
    # rows 2 and 3 each start with block 0, which row 1 holds: 512 tokens of each hit
    hits = 512 + 512
    assert trace.ideal_prefix_hit_rate() == pytest.approx(hits / sum(r.input_tokens for r in trace.rows))
    assert fit_trace(read_trace("azure", AZURE), TraceFit()).ideal_prefix_hit_rate() is None
