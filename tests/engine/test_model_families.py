"""Families beyond Llama: token-exact against transformers' eager ``generate`` through every engine path, with no
family-specific line in the engine; what cannot be served is refused at load, naming the model type and the reason.

The tiny models (``engine.tiny_model``) give Gemma 2/3 and gpt-oss 8-token sliding windows, so every prompt here
leaves them; Gemma 2 soft-caps its scores and logits, gpt-oss has attention sinks, DeepSeek-V3's value heads are
narrower than its key heads and it caches its compressed latent, and four of them route tokens to experts. The reference is eager attention, the one
implementation in transformers that runs soft-capping and sinks as the model defines them.
"""

from __future__ import annotations

import json

import pytest

from engine.config import SpeculativeConfig
from engine.request import SamplingParams
from tests.helpers.engine import Reference, handoff, random_prompts

FAMILIES = ["gemma2", "gemma3", "phi3", "granite", "cohere", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    return request.param, path, Reference(path, attn_implementation="eager")


def _assert_exact(reference: Reference, prompts, results, max_tokens: int = 10) -> None:
    for prompt, result in zip(prompts, results):
        expected = reference.greedy(prompt, max_tokens)  # stops at EOS; the engine ignores it and goes on
        assert result.token_ids[: len(expected)] == expected, f"prompt of {len(prompt)}"


def test_ragged_chunked_and_prefix_cached_steps_match_transformers(family, make_engine):
    arch, path, reference = family
    engine = make_engine(path, max_batch_tokens=48)
    prompts = random_prompts(4, 3, 90, seed=11)
    _assert_exact(reference, prompts, engine.generate(prompts, GREEDY))
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in engine.step_stats), "chunks mixed with decodes"
    shared = prompts[2][:48]  # three full blocks, reused by the next prompts
    again = [shared + [7, 8, 9], shared + [40, 41]]
    results = engine.generate(again, GREEDY)
    assert all(r.num_cached_tokens == 48 for r in results)
    _assert_exact(reference, again, results)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", *FAMILIES])
def test_no_sdpa_call_pairs_a_mask_tensor_with_grouped_query_heads(arch, make_engine, monkeypatch, tmp_path):
    """On CUDA only SDPA's math kernel takes a mask tensor with GQA, repeating K and V per query head (for an absorbed
    latent decode, the whole head count in copies): windowed prefills and latent decodes fold the query heads instead.
    A causal bias (``causal_lower_right``) is not a mask tensor: the flash kernel takes it with GQA."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import CausalBias

    real = F.scaled_dot_product_attention
    calls: list[tuple[bool, bool]] = []

    def spy(query, key, value, attn_mask=None, *args, enable_gqa=False, **kwargs):
        mask_tensor = isinstance(attn_mask, torch.Tensor) and not isinstance(attn_mask, CausalBias)
        calls.append((mask_tensor, bool(enable_gqa) or query.shape[-3] != key.shape[-3]))
        if isinstance(attn_mask, CausalBias):  # its own dispatch looks for the real function, which this one hides
            return CausalBias._dispatch(query, key, value, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)
        return real(query, key, value, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)

    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path, arch=arch)
    reference = Reference(path, attn_implementation="eager")
    engine = make_engine(path, max_batch_tokens=48)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    prompts = random_prompts(3, 20, 70, seed=13)  # chunked past every window, then decoded in one batch
    results = engine.generate(prompts, GREEDY)
    monkeypatch.undo()
    _assert_exact(reference, prompts, results)
    assert calls or arch in ("gemma2", "gpt_oss"), arch  # soft-caps and sinks attend without SDPA
    assert not [call for call in calls if all(call)], f"{arch}: {sum(all(c) for c in calls)} of {len(calls)} calls"


def test_preemption_keeps_output_exact(family, make_engine):
    arch, path, reference = family
    engine = make_engine(path, kv_blocks=12, enable_prefix_caching=False)
    prompts = random_prompts(4, 40, 40, seed=7)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    _assert_exact(reference, prompts, results, 24)


def test_prefill_decode_handoff_matches_transformers(family, make_engine):
    arch, path, reference = family
    prefill = make_engine(path, prefill_only=True)
    decode = make_engine(path)
    for i, prompt in enumerate(random_prompts(2, 20, 70, seed=5)):
        outputs = handoff(prefill, decode, prompt, GREEDY, f"h{i}")
        tokens = [t for out in outputs for t in out.new_token_ids]
        expected = reference.greedy(prompt, 10)
        assert tokens[: len(expected)] == expected


def test_verified_proposals_keep_output_exact(family, make_engine):
    """Speculative decoding: a request's last token and its proposal attend as one decode row of several queries,
    each masked to its own position (and window, soft-capped, with sinks); the output stays transformers'. The
    proposals are the reference's continuation, every third one with a wrong token, so kept and refused rows run."""
    arch, path, reference = family
    engine = make_engine(path, speculative=SpeculativeConfig(num_tokens=4))
    prompts = random_prompts(3, 20, 40, seed=5)
    expected = {tuple(p): reference.greedy(p, 16) for p in prompts}
    calls = []

    def propose(request, limit):
        done = len(request.output_token_ids)
        proposal = expected[tuple(request.prompt_token_ids)][done : done + min(limit, 4)]
        calls.append(done)
        if len(calls) % 3 == 0 and len(proposal) > 2:
            proposal[2] = (proposal[2] + 1) % engine.vocab_size
        return proposal

    engine.speculator.propose = propose
    results = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    _assert_exact(reference, prompts, results, 16)
    totals = engine.speculator.totals
    assert 0 < totals.accepted_tokens < totals.proposed_tokens
    engine.check_no_leaks()


def test_features_come_from_the_model_not_its_family(family, make_engine):
    """What the probe found is what the tiny model was built with; the KV layout is the widest head."""
    arch, path, _ = family
    engine = make_engine(path)
    attention = engine.attention
    config = json.loads((path / "config.json").read_text())
    windows = [layer.sliding_window for layer in attention.layers]
    expected = [8 if t == "sliding_attention" else None for t in config.get("layer_types") or [None] * 3]
    assert windows == expected
    assert any(layer.softcap for layer in attention.layers) == (arch == "gemma2")
    assert attention.final_logit_softcap == (10.0 if arch == "gemma2" else None)
    # a head that soft-caps or scales runs through the model's own forward; a plain one is its lm_head alone
    assert attention.plain_head == (arch not in ("gemma2", "granite", "cohere")) == engine.runner.plain_head
    assert all(layer.has_sinks for layer in attention.layers) == (arch == "gpt_oss")
    if arch == "deepseek_v3":
        # the cache holds the 32-wide latent and the 8-wide rotary key, half in each of the K and V planes: 480
        # bytes per token, against 3 layers x 4 heads x (24 key + 16 value) x 4 bytes = 1,920 decompressed
        assert {(layer.key_dim, layer.value_dim, layer.latent_width) for layer in attention.layers} == {(24, 16, 40)}
        assert (engine.kv_spec.num_kv_heads, engine.kv_spec.head_dim, engine.kv_spec.bytes_per_token) == (1, 20, 480)
        assert attention.features == ["latent attention"]
        from transfer.wire import ModelFingerprint

        assert ModelFingerprint.from_spec(engine.kv_spec).kv_layout == "latent"  # a transfer header says so
    else:
        assert engine.kv_spec.head_dim == max(max(layer.key_dim, layer.value_dim) for layer in attention.layers)


def test_a_backend_that_cannot_run_the_features_is_refused_by_name(tmp_path_factory):
    from engine.attention import select_backend

    with pytest.raises(ValueError, match="attention_backend 'flex' cannot run this model's sliding windows"):
        select_backend("flex", "cpu", None, ["sliding windows"])
    assert select_backend("auto", "cpu", None, ["logit soft-capping"]).name == "sdpa"


@pytest.mark.parametrize(
    ("model_type", "fields", "reason"),
    [
        ("t5", {}, "encoder-decoder"),
        ("llava", {}, "multimodal"),
        ("qwen3_next", {}, "linear_attention layers"),
        ("mamba", {}, "does not run its attention through transformers' attention interface"),
        ("llama4_text", {"num_hidden_layers": 4}, "chunked_attention layers"),
    ],
)
def test_models_that_cannot_work_are_refused_naming_the_type_and_reason(tmp_path, model_type, fields, reason):
    from transformers import AutoConfig

    from engine.model_loader import load_model

    AutoConfig.for_model(model_type, **fields).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"model: model type '{model_type}'.*{reason}"):
        load_model(str(tmp_path))


def test_tensor_parallelism_is_refused_for_a_plan_it_cannot_run(tmp_path):
    from transformers import AutoConfig

    from engine.tp_shard import check_degree

    config = AutoConfig.for_model("olmo2", num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    with pytest.raises(ValueError, match="tensor_parallel_size 2: model type 'olmo2'.*colwise_gather_output"):
        check_degree(config, 2)  # its q and k norms span every head: the plan gathers q and k whole
    check_degree(AutoConfig.for_model("gemma2", num_attention_heads=4, num_key_value_heads=2), 2)  # its plan runs


def test_sliding_window_layers_gather_only_blocks_their_windows_reach(tmp_path_factory, make_engine):
    """Rows at context 90 and 120 with an 8-token window: keys from position 82 on, so window layers gather from
    block 5 (of 8) while full-attention layers gather all; decoding stays exact (the family tests above)."""
    from engine.scheduler import ScheduledChunk
    from engine.tiny_model import build_tiny_model

    engine = make_engine(build_tiny_model(tmp_path_factory.mktemp("gemma3-window"), arch="gemma3"))
    assert engine.runner.sliding_windows == {8}
    for i, length in enumerate((89, 119)):
        engine.add_request(random_prompts(1, length, length, seed=i)[0], GREEDY, f"w{i}")
    engine.step()  # both prompts prefilled, each with its first token
    running = list(engine.scheduler.running)
    chunks = [ScheduledChunk(r, r.num_tokens - 1, 1) for r in running]  # the next decode step
    assert sorted(c.end for c in chunks) == [90, 120]
    _, _, batch, _ = engine.runner.build_batch(chunks)
    assert batch.decode is not None and batch.decode.window_first_block == {8: (90 - 8) // 16}
    for request in running:
        engine.abort(request.request_id)


def test_a_latent_cache_quantizes_and_hands_off_like_any_other(tmp_path_factory, make_engine):
    """DeepSeek-V3's latent rows in an int8 cache: the hand-off ships them as stored, so the decode side's tokens
    equal one engine with the same cache."""
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("deepseek-int8"), arch="deepseek_v3")
    colocated = make_engine(path, kv_cache_dtype="int8")
    prefill = make_engine(path, kv_cache_dtype="int8", prefill_only=True)
    decode = make_engine(path, kv_cache_dtype="int8")
    assert decode.kv_spec.bytes_per_token == 2 * 3 * (20 + 4)  # K and V planes of 20 int8 values and a scale
    for i, prompt in enumerate(random_prompts(2, 20, 60, seed=12)):
        [expected] = colocated.generate([prompt], GREEDY)
        outputs = handoff(prefill, decode, prompt, GREEDY, f"l{i}")
        assert [t for out in outputs for t in out.new_token_ids] == expected.token_ids


def test_decode_from_the_latent_equals_expanding_it_within_float32_rounding(tmp_path_factory):
    """Absorbing W_UK into the query and applying W_UV after attention reorders the sums of expanding every key with
    ``expand_kv``; on the tiny model's first layer the outputs differ by under 1e-5 (measured 3.6e-7 on outputs of magnitude 1.6)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from engine.attention.latent import absorbed_decode, absorbed_weights
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("deepseek-absorb"), arch="deepseek_v3")
    module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 1, 24, generator=generator)  # [B, H, 1, nope 16 + rope 8]
    context = torch.randn(3, 50, 40, generator=generator)  # latent 32 + rotary key 8
    mask = (torch.arange(50) < torch.tensor([50, 31, 7]).unsqueeze(1)).view(3, 1, 1, 50)
    with torch.inference_mode():
        k, v = module.expand_kv(context[:, None, :, :32], context[:, None, :, 32:])
        expanded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=module.scaling)[:, :, 0]
        absorbed = absorbed_decode(q, context, absorbed_weights(module, 32), mask, module.scaling)
    gap = (absorbed - expanded).abs().max().item()
    assert gap < 1e-5, gap


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_blocks_behind_every_layers_window_go_back_early(tmp_path_factory, make_engine, prefix_caching):
    """A model whose every layer slides (Mistral with an 8-token window): a long generation holds the few blocks its
    window still reaches, not its whole context, and stays exact; preemption and prefix caching go on working."""
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("mistral-window"), arch="mistral", sliding_window=8)
    reference = Reference(path, attn_implementation="eager")
    engine = make_engine(path, kv_blocks=10, enable_prefix_caching=prefix_caching)
    assert engine.scheduler.release_window == 8
    prompts = random_prompts(3, 40, 60, seed=21)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)  # 3 x 160 tokens = 30 blocks' worth through a 10-block cache
    assert all(len(r.token_ids) == 100 for r in results)
    assert engine.scheduler.num_released_blocks >= 3 * 6
    _assert_exact(reference, prompts, results, 100)


# make test compiles the family whose step differs most (windows, sinks, experts and YaRN); the others' compiled steps
# (DeepSeek's latent attention and Gemma 2's soft-caps among them) run in `make test-e2e` (the suite's 20 minutes)
COMPILED_IN_MAKE_TEST = ("gpt_oss",)


@pytest.mark.parametrize(
    "arch",
    [arch if arch in COMPILED_IN_MAKE_TEST else pytest.param(arch, marks=pytest.mark.e2e) for arch in FAMILIES],
)
def test_the_compiled_decode_step_matches_transformers(arch, make_engine, tmp_path):
    """``compile_decode_batches`` (the static decode step through torch.compile) on every family: its softcaps,
    windows, sinks, experts and latent attention compile, and greedy output stays transformers'."""
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path, arch=arch)
    reference = Reference(path, attn_implementation="eager")
    engine = make_engine(path, compile_decode_batches=[4])
    graphs = engine.runner.decode_graphs
    assert graphs is not None and set(graphs.compile_s) == {4}, arch
    prompts = random_prompts(3, 5, 40, seed=13)
    _assert_exact(reference, prompts, engine.generate(prompts, GREEDY))
    assert sum(graphs.steps.values()) >= 8 and not graphs._broken
