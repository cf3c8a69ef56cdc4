"""The hash-id -> tokens rule (bench/loadtest/trace_prompts.py): a hash id is always the same block of tokens, so two
prompts whose hash ids share a prefix share it token for token as the server sees them (completions: the prompt's
tokens; chat: the templated ones), at the scaled block size; each prompt has exactly its sent length, its scaled
length unless the template's tail forces more; rows without hash ids get unshared prompts of their length."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.loadtest.trace_prompts import TracePrompts, trace_requests
from bench.loadtest.traces import TraceFit, fit_trace, read_trace
from bench.loadtest.workloads import PromptBuilder, load_tokenizer

HERE = Path(__file__).parent / "traces"
ROWS = [  # trace-jsonl with 16-token blocks; scaled by 1/2 below: 8-token blocks
    {"arrival_s": 0.0, "input_tokens": 60, "output_tokens": 4, "hash_ids": [1, 2, 3, 4]},
    {"arrival_s": 0.5, "input_tokens": 76, "output_tokens": 4, "hash_ids": [1, 2, 3, 5, 6]},
    {"arrival_s": 1.0, "input_tokens": 30, "output_tokens": 4, "hash_ids": [1, 7]},
    {"arrival_s": 2.0, "input_tokens": 46, "output_tokens": 4, "hash_ids": [8, 2, 3]},
    {"arrival_s": 3.0, "input_tokens": 64, "output_tokens": 4, "hash_ids": [1, 2, 3, 4]},
]


@pytest.fixture(scope="module")
def tokenizer(byte_tokenizer_dir):
    return load_tokenizer(str(byte_tokenizer_dir))


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "own.jsonl"
    path.write_text("\n".join(json.dumps(row | {"block_tokens": 16}) for row in ROWS) + "\n")
    return fit_trace(read_trace("trace-jsonl", path), TraceFit(token_scale=0.5))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def shared_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return common_prefix(list(a), list(b))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_shared_hash_ids_are_shared_tokens_after_the_template(tokenizer, trace, endpoint):
    builder = PromptBuilder(tokenizer, endpoint, seed=5)
    specs, sent, _ = trace_requests(trace, builder, seed=5)
    block = sent.block_tokens
    assert block == 8
    ids = [builder.ids(spec.prompt) for spec in specs]  # as the server will tokenize them
    for spec, row, tokens in zip(specs, sent.rows, ids):
        assert len(tokens) == spec.input_tokens == row.input_tokens  # exact
        assert spec.trace_line == row.line
    for i in range(len(specs)):
        for j in range(i + 1, len(specs)):
            blocks = shared_blocks(sent.rows[i].hash_ids or (), sent.rows[j].hash_ids or ())
            shared = common_prefix(ids[i], ids[j])
            ends = min(len(ids[i]), len(ids[j])) - len(TracePrompts(builder, block, 5).frame.tail)
            assert shared >= min(blocks * block, ends), (i, j, blocks, shared)
            if blocks < min(len(sent.rows[i].hash_ids or ()), len(sent.rows[j].hash_ids or ())):
                assert shared < (blocks + 1) * block, (i, j)  # the next block differs
    # rows 1 and 5 have the same hash ids: one prompt is a prefix of the other, up to the shorter's template tail
    assert common_prefix(ids[0], ids[4]) >= len(ids[0]) - len(TracePrompts(builder, block, 5).frame.tail)


def test_a_hash_id_is_the_same_block_for_a_seed_and_another_for_another(tokenizer):
    builder = PromptBuilder(tokenizer, "completions", seed=1)
    one, again, other = TracePrompts(builder, 8, 1), TracePrompts(builder, 8, 1), TracePrompts(builder, 8, 2)
    assert one.block(42).tolist() == again.block(42).tolist() and len(one.block(42)) == 8
    assert one.block(42).tolist() != other.block(42).tolist()
    assert one.block(42).tolist() != one.block(43).tolist()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_lengths_are_the_scaled_ones_unless_the_template_forces_more(tokenizer, trace, endpoint):
    builder = PromptBuilder(tokenizer, endpoint, seed=0)
    specs, sent, lengthened = trace_requests(trace, builder, seed=0)
    prompts = TracePrompts(builder, sent.block_tokens, 0)
    head, tail = len(prompts.frame.head), len(prompts.frame.tail)
    forced = 0
    for scaled, row in zip(trace.rows, sent.rows):
        blocks = len(row.hash_ids or ())
        need = max(scaled.input_tokens, (blocks - 1) * 8 + tail, head + tail + 1)
        assert row.input_tokens == need
        forced += need != scaled.input_tokens
    assert lengthened == forced
    if endpoint == "completions":  # no template: every row at its scaled length
        assert lengthened == 0 and [r.input_tokens for r in sent.rows] == [30, 38, 15, 23, 32]


def test_the_mooncake_block_scales_with_the_token_scale(tokenizer):
    """1/32 of Mooncake's 512-token blocks: 16 tokens; every row of the excerpt starts with hash id 0, so every
    templated prompt starts with the same 16 tokens."""
    trace = fit_trace(read_trace("mooncake", HERE / "mooncake_excerpt.jsonl"), TraceFit(token_scale=1 / 32))
    builder = PromptBuilder(tokenizer, "chat", seed=3)
    specs, sent, _ = trace_requests(trace, builder, seed=3)
    assert sent.block_tokens == 16
    ids = [builder.ids(spec.prompt) for spec in specs]
    assert all(len(t) == s.input_tokens for t, s in zip(ids, specs))
    assert all(t[:16] == ids[0][:16] for t in ids)
    assert sent.ideal_prefix_hit_rate() == pytest.approx(16 * (len(ids) - 1) / sum(r.input_tokens for r in sent.rows))


def test_rows_without_hash_ids_get_unshared_prompts_of_their_length(tokenizer):
    trace = fit_trace(read_trace("azure", HERE / "azure_code_excerpt.csv"), TraceFit(token_scale=1 / 16, max_rows=8))
    builder = PromptBuilder(tokenizer, "completions", seed=0)
    specs, sent, _ = trace_requests(trace, builder, seed=0)
    ids = [builder.ids(spec.prompt) for spec in specs]
    assert [len(t) for t in ids] == [r.input_tokens for r in trace.rows]
    assert max(common_prefix(a, b) for i, a in enumerate(ids) for b in ids[i + 1 :]) < 4
    assert sent.ideal_prefix_hit_rate() is None


def test_a_row_the_template_lengthens_past_the_context_is_counted_over_it(tokenizer, tmp_path):
    path = tmp_path / "own.jsonl"
    rows = [{"arrival_s": 0, "input_tokens": 2, "output_tokens": 1, "hash_ids": [1], "block_tokens": 4}]
    path.write_text(json.dumps(rows[0]) + "\n")
    trace = fit_trace(read_trace("trace-jsonl", path), TraceFit(max_context_tokens=8))
    assert len(trace.rows) == 1  # 2 + 1 tokens fit ...
    specs, sent, _ = trace_requests(trace, PromptBuilder(tokenizer, "chat", seed=0), seed=0)
    assert specs == [] and sent.counts["over_context"] == 1  # ... but not with the chat template's tokens


@pytest.mark.skipif(
    not (Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "models").is_dir(),
    reason="the default model's tokenizer is not converted on this machine",
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_rule_holds_with_the_default_models_bpe_tokenizer(endpoint):
    try:
        tokenizer = load_tokenizer()
    except ValueError as exc:
        pytest.skip(str(exc))
    trace = fit_trace(read_trace("mooncake", HERE / "mooncake_excerpt.jsonl"), TraceFit(token_scale=1 / 32))
    builder = PromptBuilder(tokenizer, endpoint, seed=0)
    specs, sent, _ = trace_requests(trace, builder, seed=0)  # raises if a prompt's ids are not its blocks'
    ids = [builder.ids(spec.prompt) for spec in specs]
    assert [len(t) for t in ids] == [r.input_tokens for r in sent.rows]
    assert all(t[:16] == ids[0][:16] for t in ids)
