"""Speculative decoding: proposed tokens verified in the forward change how many steps a request takes, never what it
generates. Greedy output, seeded sampled output, logprobs (within float tolerance), stop strings, grammars, penalties,
the hand-off and preemption give what the same engine gives without speculation; rejected tokens' blocks go back.

A random tiny model rarely repeats itself, so most tests use an oracle proposer that knows the output the engine
gives without speculation and proposes it with a wrong token now and then: both the kept and the refused paths run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from engine.blocks import blocks_for_tokens
from engine.config import SpeculativeConfig
from engine.request import GuidedDecoding, SamplingParams
from engine.scheduler import ScheduledChunk
from engine.speculative import PAUSE_STEPS, SpecState, StepTimes, ngram_proposal, worth_verifying
from engine.tensor_parallel import StepKind, StepMessage
from tests.helpers.engine import handoff, random_prompts

SPEC = SpeculativeConfig(num_tokens=4)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _oracle(engine, references: dict[tuple[int, ...], list[int]], wrong_every: int = 3) -> list[list[int]]:
    """Make ``engine`` propose each request's reference continuation (by prompt), every ``wrong_every``-th proposal
    with its third token replaced by a wrong one; returns the proposals made, for the test to inspect."""
    made: list[list[int]] = []
    speculator = engine.speculator
    real = speculator.propose

    def propose(request, limit):
        real(request, 0)  # the request's state, as the real one makes it
        reference = references[tuple(request.prompt_token_ids)]
        done = len(request.output_token_ids)
        assert reference[:done] == request.output_token_ids  # kept tokens are always the reference's
        proposal = reference[done : done + min(limit, request.spec.num_tokens)]
        if len(made) % wrong_every == wrong_every - 1 and len(proposal) > 2:
            proposal[2] = (proposal[2] + 1) % engine.vocab_size
        made.append(list(proposal))
        return proposal

    speculator.propose = propose
    return made


def _references(engine, prompts, params) -> dict[tuple[int, ...], list[int]]:
    results = engine.generate(prompts, params)
    return {tuple(prompt): result.token_ids for prompt, result in zip(prompts, results)}


def test_ngram_proposal_takes_the_longest_latest_match():
    tokens = np.array([5, 6, 7, 8, 1, 5, 6, 9, 9, 5, 6])
    assert ngram_proposal(tokens, 3, 1, 3) == [9, 9, 5]  # "5 6" last seen before 9 9 5 (3-gram "x 5 6" unseen)
    assert ngram_proposal(tokens, 2, 1, 1) == [9, 9]  # "6": the latest occurrence followed by two tokens
    assert ngram_proposal(np.array([1, 2, 3]), 2, 1, 2) == []  # nothing repeats
    assert ngram_proposal(np.array([4, 4, 4]), 4, 1, 2) == [4]  # only one token follows the latest "4 4"


def test_each_request_proposes_as_far_as_its_acceptance_carries():
    state = SpecState(4)
    kept = []
    for _ in range(3):  # every proposal kept: up to the longest allowed
        kept.append(state.next_length())
        state.update(kept[-1], kept[-1], max_tokens=8)
    assert kept[0] == 4 and state.num_tokens == 8
    lengths = []
    while state.num_tokens:  # every proposal refused: shorter, then none
        lengths.append(state.next_length())
        state.update(lengths[-1], 0, max_tokens=8)
    assert lengths[0] == 8 and lengths[-1] == 1 and len(lengths) <= 6
    assert [state.next_length() for _ in range(PAUSE_STEPS)] == [0] * (PAUSE_STEPS - 1) + [1]  # paused, then a probe
    state.update(1, 1, max_tokens=8)
    assert state.next_length() >= 1  # kept: it goes on proposing
    assert state.proposed == sum(kept) + sum(lengths) + 1 and state.accepted == sum(kept) + 1


def test_step_times_follow_the_measured_counts_and_the_steps_that_run():
    times = StepTimes([1, 4, 8, 16], [0.050, 0.062, 0.058, 0.090])
    assert times.at(1) == 0.050 and times.at(2) == pytest.approx(0.054)
    assert times.at(8) == 0.062  # never decreasing: 8's 58 ms is noise
    assert times.at(12) == pytest.approx(0.076) and times.at(24) == pytest.approx(0.090 + 8 * 0.028 / 8)
    for _ in range(50):  # verification steps of 7 rows take 80 ms at these contexts
        times.observe(7, 0.080)
    assert times.at(8) == pytest.approx(0.080, rel=0.01)


def test_proposals_are_verified_while_they_make_more_tokens_per_second():
    flat = StepTimes([1, 8, 16, 32], [0.05, 0.05, 0.05, 0.05])  # a GPU: a row costs nothing
    steep = StepTimes([1, 8, 16, 32], [0.05, 0.08, 0.14, 0.26])  # a CPU past a few rows
    wanted = {"sure": (0.9, 4), "unsure": (0.2, 4)}
    assert worth_verifying(2, wanted, flat) == {"sure": 4, "unsure": 4}
    # batch 2 on a CPU: a row costs about 4 ms, 8% of a step: 0.9 ** j pays for it up to j = 4, 0.2 ** j never
    assert worth_verifying(2, wanted, steep) == {"sure": 4}
    # batch 8: a row costs 7.5 ms, 9% of a step: two tokens of 0.9 and 0.81 make the most tokens per second
    assert worth_verifying(8, wanted, steep) == {"sure": 2}
    assert worth_verifying(8, {"unsure": (0.2, 4)}, steep) == {}
    assert worth_verifying(8, {"certain": (1.0, 4), "sure": (0.99, 4)}, steep) == {"certain": 4, "sure": 4}


def test_greedy_output_is_unchanged_and_rejections_roll_back(tiny_llama_path, make_engine):
    plain = make_engine(tiny_llama_path)
    spec = make_engine(tiny_llama_path, speculative=SPEC)
    prompts = random_prompts(6, 3, 40, seed=1)
    params = [GREEDY, *[SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (1, 2, 7, 33, 60)]]
    references = _references(plain, prompts, params)
    made = _oracle(spec, references)
    results = spec.generate(prompts, params)
    assert [r.token_ids for r in results] == [references[tuple(p)] for p in prompts]
    totals = spec.speculator.totals
    assert totals.proposed_tokens == sum(map(len, made)) > 0
    assert 0 < totals.accepted_tokens < totals.proposed_tokens  # kept, and refused where the oracle lied
    assert totals.mean_accepted_length > 2.0
    # 6 requests took fewer steps: at most one proposal token per step is wasted per lie
    steps = sum(1 for s in spec.step_stats if s.num_decode_tokens)
    assert steps < sum(len(r.token_ids) for r in results) / 2


def test_a_refused_proposal_leaves_no_block_behind(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, speculative=SpeculativeConfig(num_tokens=8), block_size=4)
    [prompt] = random_prompts(1, 9, 9, seed=2)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.speculator.propose = lambda request, limit: [1] * min(limit, 8)  # 8 tokens: 2-3 extra blocks each step
    free_before = engine.num_free_blocks
    while engine.has_unfinished():
        engine.step()
        request = engine.requests.get(rid)
        if request is not None:
            assert len(request.block_ids) == blocks_for_tokens(request.num_tokens, 4)
            assert request.num_computed_tokens == request.num_tokens - 1
    assert engine.num_free_blocks == free_before + 0  # every block back (check_no_leaks also runs)


def test_seeded_sampling_with_penalties_and_bias_is_unchanged(tiny_llama_path, make_engine):
    plain = make_engine(tiny_llama_path)
    spec = make_engine(tiny_llama_path, speculative=SPEC)
    prompts = random_prompts(4, 4, 24, seed=3)
    params = [
        SamplingParams(max_tokens=30, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=12, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=1.5, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, temperature=0.7, seed=13, logit_bias={7: 4.0}, min_tokens=20),
    ]
    references = _references(plain, prompts, params)
    _oracle(spec, references, wrong_every=2)
    results = spec.generate(prompts, params)
    assert [r.token_ids for r in results] == [references[tuple(p)] for p in prompts]
    assert spec.speculator.totals.accepted_tokens > 0


def test_logprobs_and_stop_strings_match(tiny_llama_path, make_engine):
    plain = make_engine(tiny_llama_path)
    spec = make_engine(tiny_llama_path, speculative=SPEC)
    prompts = random_prompts(3, 5, 20, seed=4)
    [probe] = plain.generate([prompts[0]], GREEDY)
    stop = probe.text[len(probe.text) // 2 : len(probe.text) // 2 + 3]  # a stop string met mid-output
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop], ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.0, stop_token_ids=[probe.token_ids[10]], ignore_eos=True),
    ]
    ids = [plain.add_request(p, sp.copy()) for p, sp in zip([prompts[1], prompts[0], prompts[0]], params)]
    want = _collect(plain, ids)
    references = {tuple(prompts[1]): want[ids[0]][0], tuple(prompts[0]): probe.token_ids}
    _oracle(spec, references)
    ids = [spec.add_request(p, sp.copy()) for p, sp in zip([prompts[1], prompts[0], prompts[0]], params)]
    got = _collect(spec, ids)
    for (want_tokens, want_text, want_lp), (tokens, text, lp) in zip(want.values(), got.values()):
        assert tokens == want_tokens and text == want_text
        assert len(lp) == len(want_lp)
        for a, b in zip(lp, want_lp):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            # a verified position is computed in a multi-token forward: equal up to float32 rounding
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    stopped = list(got.values())[1]
    assert stop not in stopped[1] and len(stopped[0]) < 40  # cut at the stop string, as without speculation


def _collect(engine, ids):
    """Per request: its tokens from the outputs' ``new_token_ids``, its text from the deltas, its logprobs."""
    out = {rid: ([], "", []) for rid in ids}
    while engine.has_unfinished():
        for output in engine.step():
            tokens, text, logprobs = out[output.request_id]
            tokens.extend(output.new_token_ids)
            logprobs.extend(output.logprobs or [])
            out[output.request_id] = (tokens, text + output.text_delta, logprobs)
    return out


def test_guided_proposals_are_cut_by_the_grammar(tiny_llama_path, make_engine, monkeypatch):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    params = SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedDecoding("json_schema", json.dumps(schema)))
    plain = make_engine(tiny_llama_path)
    spec = make_engine(tiny_llama_path, speculative=SPEC)
    [want] = plain.generate(["Answer in JSON:"], params)
    garbage = spec.tokenizer("zzz zzz", add_special_tokens=False).input_ids
    outputs: list[list[int]] = []

    def lookup(token_ids, num_tokens, ngram_min, ngram_max):  # the reference's next token, then what JSON refuses
        done = len(token_ids) - len(want_prompt)
        return want.token_ids[done : done + 1] + garbage

    want_prompt = spec.tokenize("Answer in JSON:")
    monkeypatch.setattr("engine.speculative.ngram_proposal", lookup)
    real = spec.speculator.propose
    spec.speculator.propose = lambda request, limit: outputs.append(real(request, limit)) or outputs[-1]
    [got] = spec.generate(["Answer in JSON:"], params)
    assert got.token_ids == want.token_ids and json.loads(got.text)["ok"] in (True, False)
    assert outputs and all(len(proposal) <= 1 for proposal in outputs)  # the garbage never reached the forward
    assert spec.speculator.totals.accepted_tokens > 0


def test_handoff_and_opt_out(tiny_llama_path, make_engine):
    prefill = make_engine(tiny_llama_path, prefill_only=True, speculative=SPEC)
    decode = make_engine(tiny_llama_path, speculative=SPEC)
    plain = make_engine(tiny_llama_path)
    prompts = random_prompts(2, 10, 30, seed=5)
    references = _references(plain, prompts, GREEDY)
    assert prefill.speculator is None  # a prefill-only engine samples one token per request
    made = _oracle(decode, references, wrong_every=4)
    outputs = handoff(prefill, decode, prompts[0], GREEDY, "moved")
    assert [t for o in outputs for t in o.new_token_ids] == references[tuple(prompts[0])]
    assert made and decode.speculator.totals.accepted_tokens > 0
    # a request that opts out gets no proposal: the oracle is never asked
    before = len(made)
    opted = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculative=False)
    [result] = decode.generate([prompts[1]], opted)
    assert result.token_ids == references[tuple(prompts[1])] and len(made) == before


def test_a_sampler_fault_in_verification_fails_only_those_requests(tiny_llama_path, make_engine):
    plain = make_engine(tiny_llama_path)
    spec = make_engine(tiny_llama_path, speculative=SPEC)
    prompts = random_prompts(2, 4, 8, seed=10)
    references = _references(plain, prompts, GREEDY)
    ids = [spec.add_request(p, GREEDY.copy()) for p in prompts]
    spec.step()  # prefill: both decode from here
    first = spec.requests[ids[0]]
    proposal = references[tuple(prompts[0])][1:3]  # right: a verification round runs
    spec.speculator.propose = lambda request, limit: proposal if request is first else []
    sample = spec.sampler.sample
    calls = []

    def fails_on_verification(logits, requests, prompt_scores=()):
        calls.append([r.request_id for r in requests])
        if len(calls) > 1:
            raise RuntimeError("bitmask exploded")
        return sample(logits, requests, prompt_scores)

    spec.sampler.sample = fails_on_verification
    outputs = {o.request_id: o for o in spec.step()}
    assert calls[1] == [ids[0]]
    assert "bitmask exploded" in outputs[ids[0]].error and ids[0] not in spec.requests  # failed, blocks freed
    assert outputs[ids[1]].error is None and ids[1] in spec.requests  # the other one goes on
    spec.sampler.sample = sample
    spec.abort(ids[1])


def test_no_proposals_above_the_batch_bound(tiny_llama_path, make_engine):
    config = SpeculativeConfig(num_tokens=4, disable_above_batch=2)
    spec = make_engine(tiny_llama_path, speculative=config)
    asked: list[int] = []
    spec.speculator.propose = lambda request, limit: asked.append(len(spec.scheduler.running)) or [1]
    spec.generate(random_prompts(3, 4, 8, seed=9), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert asked == []  # three decode together: none proposes
    spec.generate(random_prompts(2, 4, 8, seed=9), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert asked and max(asked) <= 2
    with pytest.raises(ValueError, match="speculative.disable_above_batch"):
        SpeculativeConfig(disable_above_batch=0)


def test_preemption_with_proposals(tiny_llama_path, make_engine):
    plain = make_engine(tiny_llama_path, kv_blocks=14, block_size=4)
    spec = make_engine(tiny_llama_path, kv_blocks=14, block_size=4, speculative=SPEC)
    prompts = random_prompts(3, 8, 12, seed=6)
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    references = _references(plain, prompts, params)
    assert plain.scheduler.num_preemptions > 0  # the cache is too small for all three at once
    _oracle(spec, references, wrong_every=2)
    results = spec.generate(prompts, params)
    assert [r.token_ids for r in results] == [references[tuple(p)] for p in prompts]


def test_real_ngram_proposer_keeps_output(tiny_llama_path, make_engine):
    """The n-gram proposer itself on prompts that repeat: it proposes, the random model mostly refuses."""
    plain = make_engine(tiny_llama_path)
    spec = make_engine(tiny_llama_path, speculative=SPEC)
    prompts = [[3, 4, 5, 6] * 6, [9, 8, 7] * 5 + [1, 2]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in spec.generate(prompts, params)] == [
        r.token_ids for r in plain.generate(prompts, params)
    ]
    assert spec.speculator.totals.proposed_tokens > 0


def test_tensor_parallel_followers_get_the_proposal(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    rid = engine.add_request([1, 2, 3], GREEDY.copy())
    engine.step()
    request = engine.requests[rid]
    chunk = ScheduledChunk(request, request.num_computed_tokens, 4, [7, 8, 9])
    [decoded] = StepMessage.decode(StepKind.STEP, StepMessage(StepKind.STEP, [chunk]).encode()).chunks
    assert decoded.token_ids() == [request.output_token_ids[-1], 7, 8, 9] and decoded.samples
    engine.abort(rid)


def test_a_draft_model_proposes_and_output_is_unchanged(tiny_llama_path, tmp_path, make_engine):
    """The target as its own draft proposes its own greedy tokens: nearly all kept. A draft of other weights (same
    tokenizer, one layer) proposes worse: fewer kept, the output the same. The draft's engine holds nothing after."""
    from engine.tiny_model import build_tiny_model

    plain = make_engine(tiny_llama_path)
    prompts = random_prompts(4, 5, 30, seed=8)
    sampled = SamplingParams(max_tokens=25, temperature=0.9, seed=5, ignore_eos=True)
    want = [r.token_ids for r in plain.generate(prompts, GREEDY)]
    want_sampled = [r.token_ids for r in plain.generate(prompts, sampled)]
    other = build_tiny_model(tmp_path / "draft", arch="llama", seed=7, num_hidden_layers=1)
    rates = []
    for draft in (tiny_llama_path, other):
        config = SpeculativeConfig(method="draft", num_tokens=4, draft_model=str(draft), draft_kv_memory_mb=1)
        spec = make_engine(tiny_llama_path, speculative=config)
        assert [r.token_ids for r in spec.generate(prompts, GREEDY)] == want
        totals = spec.speculator.totals
        assert totals.proposed_tokens > 0
        rates.append(totals.accepted_tokens / totals.proposed_tokens)
        assert [r.token_ids for r in spec.generate(prompts, sampled)] == want_sampled  # seeded: the same draws
        spec.check_no_leaks()  # the draft engine's too
    assert rates[0] > 0.8 and rates[1] < rates[0]  # greedy rates: kept proposals over proposed


def test_draft_config_errors_name_the_field(tiny_llama_path, tiny_qwen2_path, make_engine):
    with pytest.raises(ValueError, match="speculative.draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="speculative.draft_model"):
        SpeculativeConfig(method="ngram", draft_model=str(tiny_llama_path))
    vocab = make_engine(tiny_qwen2_path).vocab_size
    if vocab != make_engine(tiny_llama_path).vocab_size:
        with pytest.raises(ValueError, match="speculative.draft_model"):
            make_engine(
                tiny_llama_path, speculative=SpeculativeConfig(method="draft", draft_model=str(tiny_qwen2_path))
            )
