"""A seeded request's tokens depend only on its seed, its prompt and its parameters: not on what shares its batch,
not on preemption, and not on which engine samples which position (the prefill worker samples the first token, the
decode worker the rest), so colocated and disaggregated serving give the same text."""

from __future__ import annotations

from engine.request import SamplingParams
from tests.helpers.engine import handoff, random_prompts

SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
PROMPT = "Once upon a time"


def _tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_seed_alone_and_in_a_mixed_batch(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [alone] = engine.generate([PROMPT], SEEDED)
    [again] = engine.generate([PROMPT], SEEDED)
    assert again.token_ids == alone.token_ids and len(alone.token_ids) == 24
    others = [
        SamplingParams(max_tokens=30, temperature=0.7, ignore_eos=True),  # unseeded: the engine's generator
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),  # greedy
        SamplingParams(max_tokens=20, temperature=1.3, min_p=0.05, seed=99, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.9, presence_penalty=1.0, logit_bias={5: 3.0}, ignore_eos=True),
    ]
    prompts = ["a different prompt", "x", "yet another one, longer than the rest of them", "zz"]
    results = engine.generate([*prompts[:2], PROMPT, *prompts[2:]], [*others[:2], SEEDED, *others[2:]])
    assert results[2].token_ids == alone.token_ids
    # a different seed draws differently (24 tokens at temperature 1 from a random model: never all equal)
    [other_seed] = engine.generate([PROMPT], _with(SEEDED, seed=1235))
    assert other_seed.token_ids != alone.token_ids
    # unseeded requests draw from the engine's own stream: two runs differ
    unseeded = _with(SEEDED, seed=None)
    assert engine.generate([PROMPT], unseeded)[0].token_ids != engine.generate([PROMPT], unseeded)[0].token_ids
    engine.check_no_leaks()


def test_seed_survives_preemption(tiny_llama_path, make_engine):
    roomy = make_engine(tiny_llama_path)
    tight = make_engine(tiny_llama_path, kv_blocks=10, block_size=16)  # two 60-token requests do not fit
    prompts = random_prompts(3, 40, 60, seed=5)
    params = [_with(SEEDED, max_tokens=40, seed=s) for s in (1, 2, 3)]
    expected = [r.token_ids for r in roomy.generate(prompts, params)]
    assert [r.token_ids for r in tight.generate(prompts, params)] == expected
    assert tight.scheduler.num_preemptions > 0
    roomy.check_no_leaks()
    tight.check_no_leaks()


def test_seed_across_the_handoff_is_one_engine(tiny_llama_path, make_engine):
    single = make_engine(tiny_llama_path)
    prefill = make_engine(tiny_llama_path, max_batch_tokens=32)  # a chunked prompt on the prefill side
    decode = make_engine(tiny_llama_path)
    decode.generate(["shift the free list"], SamplingParams(max_tokens=3))
    params = [
        SEEDED,
        _with(SEEDED, seed=7, temperature=0.8, top_p=1.0, top_k=0, min_p=0.1),
        _with(SEEDED, seed=8, frequency_penalty=0.5, repetition_penalty=1.3),
    ]
    for i, (prompt, p) in enumerate(zip(random_prompts(3, 20, 90, seed=21), params)):
        [expected] = single.generate([prompt], p)
        outputs = handoff(prefill, decode, prompt, p, f"seeded-{i}")
        assert _tokens(outputs) == expected.token_ids
        assert "".join(o.text_delta for o in outputs) == expected.text
    for engine in (single, prefill, decode):
        engine.check_no_leaks()


def _with(params: SamplingParams, **changes) -> SamplingParams:
    copy = params.copy()
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy
