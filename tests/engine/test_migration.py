"""Moving a running request between engines (migration), the KV hand-off with a decoding source: the target reserves
its context, its full blocks are copied while it decodes on (``export_held``), then it is frozen between steps, and
the target takes its tokens and the rest of its KV, in either order, and continues. The stream
(tokens, text, logprobs) equals the undisturbed run's, for greedy, seeded sampling, penalties, guided JSON, stop
strings and logprobs; a failed transfer recomputes, exact too; nothing leaks.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.request import GuidedDecoding, ImportState, RequestStatus, SamplingParams
from tests.helpers.engine import random_prompts

PROMPT = random_prompts(1, 37, 37, seed=5)[0]
CASES = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=24,
        temperature=0.8,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        repetition_penalty=1.2,
        min_tokens=20,
        ignore_eos=True,
    ),
}


def stream(engine, rid: str, outputs: list) -> None:
    """Step until the request is done, collecting its outputs."""
    for _ in range(500):
        if rid not in engine.requests:
            return
        outputs += [o for o in engine.step() if o.request_id == rid]
    raise AssertionError("the request did not finish")


def joined(outputs: list) -> tuple[list[int], str, list]:
    tokens = [t for o in outputs for t in o.new_token_ids]
    text = "".join(o.text_delta for o in outputs)
    logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
    return tokens, text, logprobs


def to_target(b, rid: str, dst: list[int]):
    """A move's sending side into engine ``b``: logical blocks onto the blocks it reserved, as the transfer would."""

    def sink(ready) -> None:
        b.kv_importer.write(rid, ready.layer, dst[ready.first_block : ready.end_block], ready.k, ready.v)

    return sink


def run_moved(a, b, prompt, params: SamplingParams, steps_before: int, transfer: str = "ok") -> list:
    """The request runs ``steps_before`` steps on ``a``; ``b`` reserves its context and takes its full blocks while
    it runs 3 steps more (``transfer="no-precopy"``: none); it is frozen on ``a``, ``b`` gets its tokens and the rest
    of its KV (or that transfer fails: ``failed``; or its tokens come after the KV: ``kv-first``), and it finishes on
    ``b``."""
    outputs: list = []
    rid = a.add_request(prompt, params.copy(), "r")
    for _ in range(steps_before):
        outputs += a.step()
    request = a.requests[rid]
    size, layers = a.config.block_size, range(a.kv_spec.num_layers)
    dst = b.kv_importer.reserve(prompt, params.copy(), "r.1", 4, context_tokens=request.num_computed_tokens)
    assert dst is not None
    sink = to_target(b, "r.1", dst)
    precopy = 0 if transfer == "no-precopy" else request.num_computed_tokens // size
    if precopy:
        a.kv_exporter.export_held(request, sink, 0, precopy, layers)
    for _ in range(3):  # it decodes on meanwhile
        outputs += a.step()
    tokens = a.freeze(rid)
    assert request.status == RequestStatus.FROZEN
    assert not a.step()  # a frozen request is not stepped
    assert tokens == [t for o in outputs for t in o.new_token_ids]
    end = -(-request.num_computed_tokens // size)
    assert len(dst) >= end  # the reservation's slack holds what it made meanwhile
    if transfer == "failed":
        b.kv_importer.tokens_in("r.1", tokens)
        assert b.kv_importer.kv_failed("r.1", recompute=True)
    else:
        a.kv_exporter.export_held(request, sink, precopy, end, layers)
        arrivals = [lambda: b.kv_importer.tokens_in("r.1", tokens), lambda: b.kv_importer.kv_done("r.1", end)]
        for arrive in reversed(arrivals) if transfer == "kv-first" else arrivals:
            arrive()
    a.release(rid)
    stream(b, "r.1", outputs)
    return outputs


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("transfer", ["ok", "kv-first", "no-precopy", "failed"])
def test_a_moved_request_streams_exactly_what_it_would_have(make_engine, tiny_llama_path, case, transfer):
    params = CASES[case]
    reference = make_engine(tiny_llama_path)
    undisturbed: list = []
    rid = reference.add_request(PROMPT, params.copy(), "r")
    stream(reference, rid, undisturbed)
    a, b = make_engine(tiny_llama_path), make_engine(tiny_llama_path)
    moved = run_moved(a, b, PROMPT, params, steps_before=9, transfer=transfer)
    tokens, text, logprobs = joined(moved)
    expected_tokens, expected_text, expected_logprobs = joined(undisturbed)
    assert (tokens, text) == (expected_tokens, expected_text)
    if transfer != "failed":  # the same KV: the same numbers
        assert logprobs == expected_logprobs
    else:  # recomputed in one prefill instead of step by step: the last bits of a logprob may differ
        assert [lp.token_id for lp in logprobs] == [lp.token_id for lp in expected_logprobs]
        assert all(abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(logprobs, expected_logprobs))
    assert moved[-1].finish_reason == undisturbed[-1].finish_reason
    assert b.num_recomputes == (transfer == "failed")


def test_guided_json_and_a_stop_string_move_exactly(make_engine, tiny_llama_path):
    """The grammar's state and the stop-string window are rebuilt from the generated tokens on the new engine."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    guided = SamplingParams(
        max_tokens=40, temperature=1.0, seed=2, guided=GuidedDecoding("json_schema", json.dumps(schema))
    )
    a, b = make_engine(tiny_llama_path), make_engine(tiny_llama_path)
    plain = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    text = a.generate([PROMPT], plain)[0].text
    prefix = a.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].text
    stop = text[len(prefix) + 2 : len(prefix) + 5]  # three characters well after the move
    assert len(stop) == 3
    stopped = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop])
    texts = []
    for params in (guided, stopped):
        undisturbed: list = []
        stream(a, a.add_request(PROMPT, params.copy(), "r"), undisturbed)
        moved = run_moved(a, b, PROMPT, params, steps_before=6)
        assert joined(moved) == joined(undisturbed)
        assert moved[-1].finish_reason == undisturbed[-1].finish_reason
        texts.append(joined(moved)[1])
    assert isinstance(json.loads(texts[0]), dict)  # the moved stream is still the schema's JSON
    assert texts[1] == text[: text.index(stop)]  # cut at the stop string, which began after the move


def test_only_a_decoding_request_freezes_and_a_frozen_one_resumes(make_engine, tiny_llama_path):
    engine = make_engine(tiny_llama_path, max_batch_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rid = engine.add_request(PROMPT, params.copy())
    engine.step()  # a 16-token chunk of a 37-token prompt
    with pytest.raises(ValueError, match="still prefilling"):
        engine.freeze(rid)
    outputs: list = []
    for _ in range(4):
        outputs += engine.step()
    engine.freeze(rid)
    assert not engine.step()  # nothing runs while it is frozen
    engine.resume(rid)
    stream(engine, rid, outputs)
    reference = make_engine(tiny_llama_path)
    expected = reference.generate([PROMPT], params)[0].token_ids
    assert [t for o in outputs for t in o.new_token_ids] == expected


def test_a_takeover_that_cannot_hold_or_would_end_is_refused(make_engine, tiny_llama_path):
    small = make_engine(tiny_llama_path, kv_blocks=5)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    # 57 tokens, the next one and 32 of headroom (room for those it makes while it moves): 6 blocks, of 5
    assert small.kv_importer.reserve(PROMPT, params.copy(), "x", 32, context_tokens=len(PROMPT) + 20) is None
    assert small.kv_importer.reserve(PROMPT, params.copy(), "x", 32, context_tokens=len(PROMPT)) is not None  # 70: 5
    small.abort("x")
    small.check_no_leaks()
    engine = make_engine(tiny_llama_path)
    with pytest.raises(ValueError, match="no running request's"):
        engine.kv_importer.reserve(PROMPT, params.copy(), "w", context_tokens=len(PROMPT) - 1)
    assert len(engine.kv_importer.reserve(PROMPT, params.copy(), "y", 32, context_tokens=len(PROMPT))) == 5
    with pytest.raises(ValueError, match="does not fit"):  # what it made meanwhile outgrew the 80 slots it got
        engine.kv_importer.tokens_in("y", list(range(51)))
    assert engine.requests["y"].kv_import.state is ImportState.RESERVED
    assert engine.kv_importer.reserve(PROMPT, SamplingParams(max_tokens=11), "z", context_tokens=len(PROMPT) + 9)
    with pytest.raises(ValueError, match="would end here"):
        engine.kv_importer.tokens_in("z", list(range(11)))
    with pytest.raises(ValueError, match="integers"):
        engine.kv_importer.tokens_in("z", [engine.vocab_size])
    engine.abort("y")
    engine.abort("z")
    engine.check_no_leaks()


def test_only_full_blocks_of_a_running_request_are_shipped_before_its_freeze(make_engine, tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    request, size = engine.requests[rid], engine.config.block_size
    computed, layers = request.num_computed_tokens, range(engine.kv_spec.num_layers)
    got: list = []
    engine.kv_exporter.export_held(request, got.append, 0, computed // size, layers)
    assert [(r.layer, r.first_block, r.end_block) for r in got] == [(layer, 0, computed // size) for layer in layers]
    k, v = engine.kv_cache.read_blocks(0, request.block_ids[: computed // size])
    assert torch.equal(got[0].k, k) and torch.equal(got[0].v, v)
    with pytest.raises(ValueError, match="has not filled"):  # its last block still changes
        engine.kv_exporter.export_held(request, got.append, 0, computed // size + 1, layers)
    engine.freeze(rid)
    engine.kv_exporter.export_held(request, got.append, 0, -(-computed // size), layers)  # frozen: all of it
    engine.abort(rid)
    engine.check_no_leaks()
