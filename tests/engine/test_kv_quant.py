"""A quantized KV cache (``kv_cache_dtype: int8 | fp8_e4m3``): rows of 8-bit values and a float32 scale per
(token, head), written quantized and dequantized inside attention, shipped as stored.

Not bitwise: a quantized cache changes what attention reads. Stated tolerances: a round trip is within half a step
(int8: ``amax / 127 / 2`` per row) or fp8's relative precision (e4m3: 2^-4 of the value, plus the scale's step near
zero); on the tiny model the chosen token's logprob moves by under 0.05 on average. What is exact: the prefill/decode
hand-off of a quantized cache equals the same engine's colocated output, because the bytes move unchanged.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from engine.kv_cache import KVCache, KVSpec
from engine.request import SamplingParams
from tests.helpers.engine import handoff, random_prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_a_round_trip_stays_within_the_format_precision(kind):
    spec = KVSpec.for_model("llama", torch.float32, 1, 2, 16, 4, kind)
    cache = KVCache(spec, 2)
    values = torch.randn(2, 5, 2, 16) * torch.logspace(-3, 2, 5).view(1, 5, 1, 1)  # rows of very different scale
    back = cache.dequantize(cache.quantize(values), torch.float32)
    amax = values.abs().amax(dim=-1, keepdim=True)
    if kind == "int8":
        assert ((back - values).abs() <= amax / 127 / 2 * 1.001).all()
    else:
        assert ((back - values).abs() <= values.abs() / 16 + amax / 448 * 2**-9 + 1e-12).all()
    assert spec.head_dim == 20 and spec.model_head_dim == 16 and spec.dtype == torch.uint8


def _logprob_gaps(plain, quantized, prompts) -> tuple[list[float], int]:
    """|Δ logprob| of each greedy token while both engines' contexts are identical, and how many prompts' first
    tokens agree."""
    gaps, first_agree = [], 0
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        outs = {}
        for name, engine in (("plain", plain), ("quantized", quantized)):
            engine.add_request(prompt, params.copy(), f"{name}{i}")
            outs[name] = [o for _ in range(50) if engine.has_unfinished() for o in engine.step()]
        first_agree += outs["plain"][0].new_token_ids == outs["quantized"][0].new_token_ids
        for a, b in zip(outs["plain"], outs["quantized"]):
            gaps.append(abs(a.logprobs[0].logprob - b.logprobs[0].logprob))
            if a.new_token_ids != b.new_token_ids:
                break
    return gaps, first_agree


def test_a_quantized_cache_holds_more_tokens_and_stays_close(tiny_llama_path, make_engine):
    plain = make_engine(tiny_llama_path, kv_cache_memory_bytes=1 << 20, kv_blocks=None)
    int8 = make_engine(tiny_llama_path, kv_cache_memory_bytes=1 << 20, kv_blocks=None, kv_cache_dtype="int8")
    # 3 layers x 2 heads x (16 values + 4 scale bytes) x K,V = 240 bytes, against 768 in float32
    assert (int8.kv_spec.bytes_per_token, plain.kv_spec.bytes_per_token) == (240, 768)
    assert int8.num_free_blocks >= 3 * plain.num_free_blocks
    gaps, first_agree = _logprob_gaps(plain, int8, random_prompts(6, 20, 80, seed=4))
    assert first_agree == 6  # the prompt attended to its own fresh K/V (sdpa)
    assert statistics.mean(gaps) < 0.05, f"mean |logprob gap| {statistics.mean(gaps):.4f}"


def test_the_flex_backend_reads_a_quantized_cache(tiny_llama_path, make_engine):
    """Flex reads every key from the cache, the prompt's own too, so even its first token sees int8 K/V."""
    plain = make_engine(tiny_llama_path, attention_backend="flex")
    int8 = make_engine(tiny_llama_path, attention_backend="flex", kv_cache_dtype="int8")
    gaps, first_agree = _logprob_gaps(plain, int8, random_prompts(6, 20, 80, seed=4))
    assert first_agree >= 4 and statistics.mean(gaps) < 0.05, (first_agree, statistics.mean(gaps))


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_the_handoff_ships_quantized_blocks_unchanged(tiny_llama_path, make_engine, kind):
    colocated = make_engine(tiny_llama_path, kv_cache_dtype=kind)
    prefill = make_engine(tiny_llama_path, kv_cache_dtype=kind, prefill_only=True)
    decode = make_engine(tiny_llama_path, kv_cache_dtype=kind)
    for i, prompt in enumerate(random_prompts(3, 20, 70, seed=9)):
        [expected] = colocated.generate([prompt], GREEDY)
        outputs = handoff(prefill, decode, prompt, GREEDY, f"q{i}")
        assert [t for out in outputs for t in out.new_token_ids] == expected.token_ids


def test_a_quantized_cache_survives_preemption_and_prefix_reuse(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, kv_blocks=12, kv_cache_dtype="int8")
    prompts = random_prompts(4, 40, 40, seed=7)
    results = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert all(len(r.token_ids) == 30 for r in results)
    [prompt] = random_prompts(1, 48, 48, seed=8)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [first] = engine.generate([prompt], short)
    [again] = engine.generate([prompt], short)
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)  # the last block is recomputed for logits


def test_the_transfer_fingerprint_tells_the_formats_apart(tiny_llama_path):
    from transfer.wire import ModelFingerprint

    plain = KVSpec.for_model("llama", torch.float32, 3, 2, 16, 16)
    int8 = KVSpec.for_model("llama", torch.float32, 3, 2, 16, 16, "int8")
    fp8 = KVSpec.for_model("llama", torch.float32, 3, 2, 16, 16, "fp8_e4m3")
    prints = [ModelFingerprint.from_spec(spec) for spec in (plain, int8, fp8)]
    assert len(set(prints)) == 3
    assert (prints[1].dtype, prints[1].kv_format, prints[1].head_dim) == ("uint8", "int8", 20)


def test_bad_cache_dtypes_are_refused_naming_the_field():
    from cluster.config import ConfigError, parse_config
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' .* not by attention_backend 'flashinfer'"):
        EngineConfig(kv_cache_dtype="int8", attention_backend="flashinfer")
    with pytest.raises(ConfigError, match="pools.decode.kv_cache_dtype 'auto' differs from pools.prefill"):
        parse_config({"pools": {"prefill": {"kv_cache_dtype": "int8"}}})
    with pytest.raises(ConfigError, match="transfer.kv_wire_dtype 'int8' would compress an already quantized"):
        parse_config(
            {
                "transfer": {"kv_wire_dtype": "int8"},
                "pools": {p: {"kv_cache_dtype": "int8"} for p in ("prefill", "decode")},
            }
        )
    config = parse_config({"pools": {p: {"kv_cache_dtype": "fp8_e4m3"} for p in ("prefill", "decode")}})
    assert config.engine_config(config.pools.decode, "m").kv_cache_dtype == "fp8_e4m3"
