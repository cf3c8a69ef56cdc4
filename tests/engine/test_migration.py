"""Moving a running request between engines (migration) by pre-copy: its full blocks copied while it decodes on, then
frozen between steps, its tokens and the rest of its KV taken over by another engine, which continues. The stream
(tokens, text, logprobs) equals the undisturbed run's, for greedy, seeded sampling, penalties, guided JSON, stop
strings and logprobs; a failed transfer recomputes, exact too; nothing leaks.
"""

from __future__ import annotations

import json

import pytest

from engine.request import GuidedDecoding, RequestStatus, SamplingParams
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


def copy_kv(a, b, rid: str, src: list[int], dst: list[int]) -> None:
    """Layer by layer, as the transfer layer would."""
    for layer in range(a.kv_spec.num_layers):
        k, v = a.kv_cache.read_blocks(layer, src)
        b.write_remote_kv(rid, layer, dst, k, v)


def run_moved(a, b, prompt, params: SamplingParams, steps_before: int, transfer: str = "ok") -> list:
    """The request runs ``steps_before`` steps on ``a``; ``b`` reserves its context and takes its full blocks while
    it runs 3 steps more (``transfer="no-precopy"``: none); it is frozen on ``a``, ``b`` adopts its tokens and the
    rest of its KV (or that transfer fails), and it finishes on ``b``."""
    outputs: list = []
    rid = a.add_request(prompt, params.copy(), "r")
    for _ in range(steps_before):
        outputs += a.step()
    computed = a.requests[rid].num_computed_tokens
    precopy = 0 if transfer == "no-precopy" else (computed - 1) // a.config.block_size
    dst = b.reserve_migration(prompt, params.copy(), "r.1", computed, precopy_blocks=precopy, headroom_tokens=4)
    assert dst is not None
    if precopy:
        copy_kv(a, b, "r.1", a.kv_blocks(rid, 0, precopy), dst[:precopy])
        b.precopy_done("r.1")
    for _ in range(3):  # it decodes on meanwhile
        outputs += a.step()
    tokens, computed = a.freeze(rid)
    assert a.requests[rid].status == RequestStatus.FROZEN
    assert not a.step()  # a frozen request is not stepped
    assert tokens == [t for o in outputs for t in o.new_token_ids]
    tail = b.adopt_migrated("r.1", tokens, computed, first_block=precopy, headroom_tokens=4)
    assert tail is not None and tail[0] == dst[precopy] and len(tail) == -(-computed // a.config.block_size) - precopy
    if transfer != "failed":
        copy_kv(a, b, "r.1", a.kv_blocks(rid, precopy), tail)
        assert b.remote_kv_done("r.1")
    else:
        assert b.remote_kv_failed("r.1", recompute=True)
    a.release(rid)
    stream(b, "r.1", outputs)
    return outputs


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("transfer", ["ok", "no-precopy", "failed"])
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
    small = make_engine(tiny_llama_path, kv_blocks=3)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    tokens = list(range(10))
    computed = len(PROMPT) + 9
    # 47 tokens and 10 of headroom: 4 blocks, of 3
    assert small.reserve_migration(PROMPT, params.copy(), "x", computed, headroom_tokens=10) is None
    assert small.reserve_migration(PROMPT, params.copy(), "x", len(PROMPT) + 1) is not None  # 3 blocks
    assert small.adopt_migrated("x", tokens, computed, headroom_tokens=10) is None  # cannot grow: as it was
    assert len(small.requests["x"].block_ids) == 3 and small.requests["x"].remote.resume_at is None
    small.abort("x")
    small.check_no_leaks()
    engine = make_engine(tiny_llama_path)
    with pytest.raises(ValueError, match="more than"):
        engine.reserve_migration(PROMPT, params.copy(), "w", computed, precopy_blocks=4)
    assert engine.reserve_migration(PROMPT, params.copy(), "y", computed) is not None
    with pytest.raises(ValueError, match="every token but the last"):
        engine.adopt_migrated("y", tokens, len(PROMPT))
    with pytest.raises(ValueError, match="were not pre-copied"):
        engine.adopt_migrated("y", tokens, computed, first_block=1)
    assert engine.reserve_migration(PROMPT, SamplingParams(max_tokens=11), "z", computed) is not None
    with pytest.raises(ValueError, match="would end here"):
        engine.adopt_migrated("z", tokens + [5], computed + 1)
    engine.abort("y")
    engine.abort("z")
    engine.check_no_leaks()


def test_only_full_blocks_of_a_running_request_are_shipped_before_its_freeze(make_engine, tiny_llama_path):
    engine = make_engine(tiny_llama_path)
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    computed, size = engine.requests[rid].num_computed_tokens, engine.config.block_size
    assert engine.kv_blocks(rid, 0, computed // size) == engine.requests[rid].block_ids[: computed // size]
    with pytest.raises(ValueError, match="has not filled"):
        engine.kv_blocks(rid, 0, computed // size + 1)
    with pytest.raises(ValueError, match="only a frozen request's last blocks"):
        engine.kv_blocks(rid)
    engine.abort(rid)
    engine.check_no_leaks()
