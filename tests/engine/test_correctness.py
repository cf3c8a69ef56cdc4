"""Greedy output must equal transformers ``generate`` token for token, however the engine batches, chunks or caches."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams
from tests.helpers.engine import random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request, tiny_llama_path, tiny_qwen2_path, llama_reference, qwen2_reference):
    if request.param == "llama":
        return tiny_llama_path, llama_reference
    return tiny_qwen2_path, qwen2_reference


def test_single_prompt_matches_transformers(tiny, make_engine):
    path, reference = tiny
    engine = make_engine(path)
    prompt = engine.tokenize("The capital of France is")
    [result] = engine.generate([prompt], GREEDY)
    assert result.token_ids == reference.greedy(prompt, len(result.token_ids))
    assert len(result.token_ids) == 12 or result.finish_reason == "stop"


def test_ragged_batch_matches_transformers(tiny, make_engine):
    path, reference = tiny
    engine = make_engine(path)
    prompts = random_prompts(10, 1, 300, seed=1)
    prompts[0] = prompts[0][:1]
    prompts[1] = (prompts[1] * 300)[:300]
    results = engine.generate(prompts, GREEDY)
    # all ten were prefilled in one ragged forward, then decoded together
    assert max(s.num_seqs for s in engine.step_stats) == 10
    for prompt, result in zip(prompts, results):
        assert result.token_ids == reference.greedy(prompt, len(result.token_ids))


def test_requests_joining_mid_generation(tiny, make_engine):
    path, reference = tiny
    engine = make_engine(path)
    prompts = random_prompts(6, 5, 80, seed=2)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    outputs: dict[str, list[int]] = {}
    for step in range(40):
        if step == 4:
            ids += [engine.add_request(p, params) for p in prompts[2:4]]
        if step == 9:
            ids += [engine.add_request(p, params) for p in prompts[4:]]
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished()
    mixed_steps = [s for s in engine.step_stats if s.num_prefill_tokens and s.num_decode_tokens]
    assert mixed_steps, "late prompts should have been prefilled in the same forward as running decodes"
    for rid, prompt in zip(ids, prompts):
        assert len(outputs[rid]) == 16
        ref = reference.greedy(prompt, 16)
        # the reference may stop at EOS; ignore_eos goes on past it
        assert outputs[rid][: len(ref)] == ref


def test_chunked_prefill_matches_transformers(tiny, make_engine):
    path, reference = tiny
    engine = make_engine(path, max_batch_tokens=64)
    [prompt] = random_prompts(1, 300, 300, seed=3)
    [result] = engine.generate([prompt], GREEDY)
    assert max(s.num_tokens for s in engine.step_stats) <= 64
    assert sum(1 for s in engine.step_stats if s.num_prefill_tokens) >= 5
    assert result.token_ids == reference.greedy(prompt, len(result.token_ids))


def test_shared_prefix_reuses_cached_blocks(tiny, make_engine):
    path, reference = tiny
    engine = make_engine(path)
    [prefix] = random_prompts(1, 64, 64, seed=4)
    first, second = prefix + [10, 20, 30], prefix + [40, 50, 60, 70]
    [r1] = engine.generate([first], GREEDY)
    free_before = engine.num_free_blocks
    [r2] = engine.generate([second], GREEDY)
    assert r1.num_cached_tokens == 0
    assert r2.num_cached_tokens == 64
    assert engine.num_free_blocks == free_before
    assert r1.token_ids == reference.greedy(first, len(r1.token_ids))
    assert r2.token_ids == reference.greedy(second, len(r2.token_ids))


def test_identical_prompt_fully_cached_still_matches(tiny, make_engine):
    path, reference = tiny
    engine = make_engine(path)
    [prompt] = random_prompts(1, 48, 48, seed=5)
    [r1] = engine.generate([prompt], GREEDY)
    [r2] = engine.generate([prompt], GREEDY)
    assert r2.num_cached_tokens == 32  # the last block is recomputed to get its logits
    assert r1.token_ids == r2.token_ids == reference.greedy(prompt, len(r1.token_ids))


def test_prefix_caching_can_be_turned_off(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, enable_prefix_caching=False)
    [prompt] = random_prompts(1, 64, 64, seed=6)
    engine.generate([prompt], GREEDY)
    [again] = engine.generate([prompt], GREEDY)
    assert again.num_cached_tokens == 0


def test_preemption_under_block_pressure_keeps_output_exact(tiny_llama_path, llama_reference, make_engine):
    # 12 blocks of 16 tokens: four 40-token prompts fit, but not their 40 generated tokens each
    engine = make_engine(tiny_llama_path, kv_blocks=12, enable_prefix_caching=False)
    prompts = random_prompts(4, 40, 40, seed=7)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for prompt, result in zip(prompts, results):
        ref = llama_reference.greedy(prompt, 40)
        assert result.token_ids[: len(ref)] == ref


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_path, make_engine):
    from tests.helpers.engine import Reference

    reference = Reference(smollm2_path)
    engine = make_engine(smollm2_path)
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Name three colors."}], tokenize=False, add_generation_prompt=True
        ),
    ]
    token_prompts = [engine.tokenize(p) for p in prompts]
    results = engine.generate(token_prompts, SamplingParams(max_tokens=16, temperature=0.0))
    for prompt, result in zip(token_prompts, results):
        assert result.token_ids == reference.greedy(prompt, len(result.token_ids))
    assert results[0].text.startswith(" Paris")


def test_a_request_that_alone_would_fill_the_kv_cache_ends_with_length(tiny_llama_path, make_engine):
    """Past the whole cache it could only preempt itself and recompute, forever: it stops where the cache is full."""
    engine = make_engine(tiny_llama_path, kv_blocks=4, enable_prefix_caching=False)  # 4 blocks of 16: 64 tokens
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    [result] = engine.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    assert result.finish_reason == "length" and len(prompt) + len(result.token_ids) == 64
    assert engine.scheduler.num_preemptions == 0
    engine.check_no_leaks()
