"""Attention backends: each one's greedy output equals transformers ``generate`` token for token, however the engine
batches, chunks or caches; the selection rules; FlashInfer's batch description computed from our block tables (the
FlashInfer kernels themselves need a GPU and are not run here); and the step's metadata packed into one buffer."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch.nn.attention.bias import CausalBias

import engine.attention.sdpa as sdpa
from engine.attention import SeqLayout, select_backend
from engine.attention.backend import resolve_backend_name
from engine.attention.flashinfer_backend import paged_kv_metadata
from engine.attention.metadata import MetadataPacker, build_layout, layout_spans, slot_list
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs, StaticStep
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from engine.scheduler import ScheduledChunk
from tests.helpers.engine import random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
BACKENDS = ["sdpa", "flex"]


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request, tiny_llama_path, tiny_qwen2_path, llama_reference, qwen2_reference):
    if request.param == "llama":
        return tiny_llama_path, llama_reference
    return tiny_qwen2_path, qwen2_reference


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_matches_transformers(backend, tiny, make_engine):
    path, reference = tiny
    engine = make_engine(path, attention_backend=backend)
    assert engine.runner.backend.name == backend
    prompts = random_prompts(8, 1, 200, seed=11)
    prompts[0] = prompts[0][:1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # flex's "called without torch.compile" warning is silenced deliberately
        results = engine.generate(prompts, GREEDY)
    assert max(s.num_seqs for s in engine.step_stats) == 8
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference.greedy(prompt, len(result.token_ids))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_prefill_and_decode_steps_match_transformers(backend, tiny_llama_path, llama_reference, make_engine):
    engine = make_engine(tiny_llama_path, attention_backend=backend, max_batch_tokens=48)
    prompts = random_prompts(5, 5, 90, seed=12)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    outputs: dict[str, list[int]] = {}
    for step in range(80):
        if step == 3:
            ids += [engine.add_request(p, params) for p in prompts[2:]]
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    stats = engine.step_stats
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats), "no step mixed prefill and decode"
    assert any(s.num_prefill_tokens > 1 and s.num_tokens == 48 for s in stats), "no prompt was chunked"
    for rid, prompt in zip(ids, prompts):
        ref = llama_reference.greedy(prompt, 10)
        assert outputs[rid][: len(ref)] == ref


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_and_cached_prefix_match_transformers(backend, tiny_qwen2_path, qwen2_reference, make_engine):
    engine = make_engine(tiny_qwen2_path, attention_backend=backend, max_batch_tokens=64)
    [prefix] = random_prompts(1, 150, 150, seed=13)
    first, second = prefix + [1, 2, 3], prefix + [4, 5, 6, 7]
    [r1] = engine.generate([first], GREEDY)
    [r2] = engine.generate([second], GREEDY)
    assert sum(1 for s in engine.step_stats if s.num_prefill_tokens) >= 4
    assert r2.num_cached_tokens == 144  # nine whole blocks of the prefix came from the cache
    assert r1.token_ids == qwen2_reference.greedy(first, len(r1.token_ids))
    assert r2.token_ids == qwen2_reference.greedy(second, len(r2.token_ids))


def test_flex_and_sdpa_attend_alike_layer_by_layer(tiny_llama_path):
    """Same weights, same mixed step (a chunked prompt and running decodes): the last hidden states agree."""
    engines = {
        name: LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=64, attention_backend=name))
        for name in BACKENDS
    }
    hidden = {}
    for name, engine in engines.items():
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        for prompt in random_prompts(3, 20, 40, seed=14):
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        requests = [engine.add_request(p, params) for p in random_prompts(2, 30, 30, seed=15)]
        engine.step()  # both prompts prefilled: their next step decodes
        req_a, req_b = (engine.requests[r] for r in requests)
        chunks = [ScheduledChunk(req_a, req_a.num_tokens - 1, 1), ScheduledChunk(req_b, 10, req_b.num_tokens - 11)]
        input_ids, positions, batch, _ = engine.runner.build_batch(chunks)
        with torch.inference_mode():
            out = engine.runner.decoder(input_ids=input_ids, position_ids=positions, use_cache=False, pd_batch=batch)
        hidden[name] = out.last_hidden_state
        for rid in requests:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
        engine.check_no_leaks()
    torch.testing.assert_close(hidden["flex"], hidden["sdpa"], atol=1e-5, rtol=1e-5)


def test_sdpa_calls_have_shapes_a_fused_cuda_kernel_takes(tiny_llama_path, llama_reference, make_engine, monkeypatch):
    """No fused SDPA kernel takes GQA with a mask tensor (the math kernel would run, in float32). Over uneven decode
    contexts, chunked and prefix-cached prefills and the static (CUDA-graph) decode step, every SDPA call either has
    no mask tensor or equal query and KV head counts; decode calls and prefix-cached prefill chunks fold the query
    heads (no ``enable_gqa``); no lower-right causal bias with GQA (where flash does not run it is materialized into a
    mask beside GQA). Outputs stay token-exact."""
    real = sdpa.F.scaled_dot_product_attention
    calls: list[dict] = []

    def spy(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        calls.append(dict(q=tuple(q.shape), k=tuple(k.shape), mask=attn_mask, causal=is_causal, gqa=enable_gqa))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(sdpa, "F", types.SimpleNamespace(scaled_dot_product_attention=spy))  # this module's calls
    engine = make_engine(tiny_llama_path, max_batch_tokens=32, block_size=4)
    heads, kv_heads = engine.model.config.num_attention_heads, engine.model.config.num_key_value_heads
    assert heads > kv_heads  # the tiny llama is a GQA model: the case that matters
    [prefix] = random_prompts(1, 40, 40, seed=21)
    prompts = [prefix + [1, 2], prefix + [3], *random_prompts(3, 5, 30, seed=22)]  # uneven lengths, a shared prefix
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = engine.generate(prompts, params)
    engine.runner.decode_graphs = DecodeGraphs(engine.runner, engine.config.max_num_seqs, 256, StaticStep.EAGER)
    engine.block_manager.reset_prefix_cache()
    static = engine.generate(prompts, params)
    for prompt, a, b in zip(prompts, eager, static):
        assert a.token_ids == b.token_ids == llama_reference.greedy(prompt, 6)
    lower_right = [c for c in calls if isinstance(c["mask"], CausalBias)]
    masked = [c for c in calls if isinstance(c["mask"], torch.Tensor) and not isinstance(c["mask"], CausalBias)]
    folded = [c for c in calls if c["q"][1] == kv_heads and c["q"][2] == heads // kv_heads]
    assert masked and not lower_right  # padded decodes (eager and static), chunked and prefix-cached prefills
    for call in masked:  # every mask tensor goes with folded heads: one query head per KV head
        assert call["q"][1] == call["k"][1] == kv_heads and not call["gqa"]
    decodes = [c for c in masked if c["q"][2] == heads // kv_heads]
    chunks = [c for c in masked if c["q"][2] > heads // kv_heads and c["q"][2] % (heads // kv_heads) == 0]
    assert decodes and chunks  # both kinds ran folded
    assert not any(c["gqa"] for c in folded)


# ---- selection ------------------------------------------------------------------------------------------------------


def test_auto_picks_sdpa_on_cpu_and_flashinfer_only_where_it_can_run(monkeypatch):
    assert select_backend("auto", "cpu").name == "sdpa"
    assert select_backend("flex", "cpu").name == "flex"
    monkeypatch.setattr("engine.attention.backend.flashinfer_importable", lambda: False)
    assert resolve_backend_name("auto", "cuda") == "sdpa"
    monkeypatch.setattr("engine.attention.backend.flashinfer_importable", lambda: True)
    assert resolve_backend_name("auto", "cuda:0") == "flashinfer"
    assert resolve_backend_name("auto", "cpu") == "sdpa"
    assert resolve_backend_name("flashinfer", "cuda") == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.bfloat16) == "flashinfer"
    assert resolve_backend_name("auto", "cuda", torch.float32) == "sdpa"  # FlashInfer has no float32 kernels


def test_flashinfer_where_it_cannot_run_is_an_error_naming_the_field(monkeypatch):
    with pytest.raises(ValueError, match="attention_backend 'flashinfer' needs a CUDA device"):
        select_backend("flashinfer", "cpu")
    monkeypatch.setattr("engine.attention.backend.flashinfer_importable", lambda: False)
    with pytest.raises(ValueError, match="attention_backend 'flashinfer' needs the flashinfer-python package"):
        select_backend("flashinfer", "cuda")
    monkeypatch.setattr("engine.attention.backend.flashinfer_importable", lambda: True)
    with pytest.raises(ValueError, match="attention_backend 'flashinfer' needs float16 or bfloat16"):
        select_backend("flashinfer", "cuda", torch.float32)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        select_backend("xformers", "cpu")


def test_engine_refuses_flashinfer_on_cpu(tiny_llama_path):
    with pytest.raises(ValueError, match="attention_backend"):
        LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=16, attention_backend="flashinfer"))


# ---- FlashInfer's batch description ---------------------------------------------------------------------------------


def test_flashinfer_metadata_from_block_tables():
    # block size 4; A: a 3-token prompt in block 7 (block 2 allocated ahead, unused); B: a decode at context 9 over
    # blocks 1, 5, 3 (the 9th token opens block 3); C: a 4-token chunk ending at context 8 over blocks 4, 6 (9 ahead)
    table = torch.tensor([[7, 2, 0], [1, 5, 3], [4, 6, 9]])
    m = paged_kv_metadata(q_lens=[3, 1, 4], context_lens=[3, 9, 8], block_table=table, block_size=4)
    assert m.qo_indptr.tolist() == [0, 3, 4, 8]
    assert m.kv_indptr.tolist() == [0, 1, 4, 6]
    assert m.kv_indices.tolist() == [7, 1, 5, 3, 4, 6]
    assert m.kv_last_page_len.tolist() == [3, 1, 4]
    assert {t.dtype for t in (m.qo_indptr, m.kv_indptr, m.kv_indices, m.kv_last_page_len)} == {torch.int32}


def test_flashinfer_metadata_rejects_a_context_past_its_blocks():
    with pytest.raises(ValueError, match="longer than its block table row"):
        paged_kv_metadata([1], [9], torch.tensor([[1, 2]]), block_size=4)
    with pytest.raises(ValueError, match="at least one token"):
        paged_kv_metadata([1], [0], torch.tensor([[1]]), block_size=4)


def test_layout_packs_the_used_blocks_and_matches_flashinfer_metadata():
    packer = MetadataPacker()
    ids = packer.add([5, 6, 7])
    spans = layout_spans(packer, [3, 1, 4], [3, 9, 8], [[7, 2], [1, 5, 3], [4, 6, 9]], block_size=4)
    host, device = packer.transfer(torch.device("cpu"))
    layout: SeqLayout = build_layout(spans, host, device)
    assert device[ids].tolist() == [5, 6, 7]
    assert layout.query_start_loc.tolist() == [0, 3, 4, 8]
    assert layout.seq_context_lens.tolist() == [3, 9, 8]
    assert layout.block_table.tolist() == [[7, 0, 0], [1, 5, 3], [4, 6, 0]]  # only the blocks each context uses
    m = paged_kv_metadata(layout.q_lens, layout.context_lens, layout.host_block_table, block_size=4)
    assert m.kv_indices.tolist() == [7, 1, 5, 3, 4, 6]


def test_slot_list_crosses_blocks():
    # positions 2..9 with block size 4 over blocks [10, 3, 8]: 42, 43 | 12, 13, 14, 15 | 32, 33
    assert slot_list([10, 3, 8], 2, 10, 4) == [42, 43, 12, 13, 14, 15, 32, 33]
    assert slot_list([10, 3, 8], 9, 10, 4) == [33]
    assert slot_list([10], 0, 0, 4) == []


# ---- one packed transfer per step -----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_metadata_is_one_buffer(backend, tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, attention_backend=backend)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in random_prompts(3, 20, 40, seed=16)]
    engine.step()
    running = [engine.requests[r] for r in rids]
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1) for r in running]
    input_ids, positions, batch, _ = engine.runner.build_batch(chunks)
    tensors = [input_ids, positions, batch.slot_mapping]
    if backend == "sdpa":
        assert batch.decode is not None
        tensors.append(batch.decode.block_table)
    else:
        assert batch.layout is not None
        tensors += [batch.layout.block_table, batch.layout.query_start_loc, batch.layout.seq_context_lens]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert positions[0].tolist() == [r.num_tokens - 1 for r in running]
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
