"""An engine rebuilt under another config with the same weights (a worker switching role): a new KV cache and
scheduler of the new size, the model object kept, the same greedy tokens as transformers; refused while it holds a
request or for a config the weights do not serve."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from tests.helpers.engine import handoff, random_prompts


def _config(path, **overrides) -> EngineConfig:
    settings = dict(model=str(path), kv_blocks=32, compile_decode_background=False)
    settings.update(overrides)
    return EngineConfig(**settings)


def test_a_prefill_engine_becomes_a_decode_engine_with_the_same_weights(tiny_llama_path, llama_reference):
    prefill = LLMEngine(_config(tiny_llama_path, kv_blocks=16, prefill_only=True, max_num_seqs=4))
    prefill.warm_up()
    model = prefill.model
    decode = prefill.reconfigured(_config(tiny_llama_path, kv_blocks=96, max_num_seqs=8))
    assert decode.model is model  # no load
    assert decode.block_manager.num_blocks == 96 and decode.config.max_num_seqs == 8
    assert not decode.config.prefill_only
    assert prefill.kv_cache.kv == []  # the old cache was let go
    prompts = random_prompts(4, 5, 40, seed=3)
    results = decode.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        assert result.token_ids == llama_reference.greedy(prompt, 8)
    decode.check_no_leaks()


def test_a_decode_engine_becomes_a_prefill_engine_and_hands_off(tiny_llama_path, llama_reference):
    """Back the other way: the rebuilt engine prefills and exports, and a decode engine continues token-exact."""
    decode = LLMEngine(_config(tiny_llama_path, kv_blocks=96))
    decode.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    prefill = decode.reconfigured(_config(tiny_llama_path, kv_blocks=16, prefill_only=True))
    assert prefill.block_manager.num_blocks == 16 and prefill.config.prefill_only
    target = LLMEngine(_config(tiny_llama_path, kv_blocks=64))
    prompt = random_prompts(1, 30, 30, seed=9)[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = handoff(prefill, target, prompt, params, "r1")
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == llama_reference.greedy(prompt, 6)
    prefill.check_no_leaks()
    target.check_no_leaks()


def test_a_busy_engine_or_other_weights_are_refused_and_the_engine_serves_on(tiny_llama_path, tiny_qwen2_path):
    engine = LLMEngine(_config(tiny_llama_path))
    engine.add_request([1, 2, 3, 4], SamplingParams(max_tokens=3, temperature=0.0), "held")
    with pytest.raises(ValueError, match="holds 1 requests"):
        engine.reconfigured(_config(tiny_llama_path, kv_blocks=64))
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="^model: "):
        engine.reconfigured(_config(tiny_qwen2_path))
    with pytest.raises(ValueError, match="^dtype: "):
        engine.reconfigured(_config(tiny_llama_path, dtype="bfloat16"))
    [result] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))  # untouched
    assert len(result.token_ids) == 2
    engine.check_no_leaks()
