"""The KV connector: the prefill -> decode hand-off through the engine's own API, with no worker in between.

A prefill engine reports a request's completed blocks to its KV sink; the sink here is the transfer layer in
miniature (each report lands in the decode engine's reserved blocks at once). The decode engine admits the request
when its KV and its first token are both in. Whatever the order, the chunking or the failure, the client must get
exactly what one engine's ``generate`` gives, and no block or request may be left behind.
"""

from __future__ import annotations

import time

import pytest
import torch

from engine.blocks import blocks_for_tokens, reserved_blocks
from engine.kv_connector import KVBlocksReady
from engine.request import FinishReason, ImportState, RequestStatus, SamplingParams
from tests.engine.test_text_deltas import _spanning_stop
from tests.helpers.engine import random_prompts

BLOCK = 16  # the engines' block size (EngineConfig's default)


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
    )


class Wire:
    """A KV sink that writes every report straight into the decode engine's blocks reserved for the request."""

    def __init__(self, decode, dst_blocks: list[int], step_counter: list[int] | None = None) -> None:
        self.decode, self.dst = decode, dst_blocks
        self.step_counter = step_counter
        self.reports: list[tuple[int, int, int]] = []  # (layer, first_block, end_block)
        self.steps: list[int] = []  # the prefill step each report came in

    def __call__(self, ready: KVBlocksReady) -> None:
        assert ready.k.shape[0] == ready.end_block - ready.first_block == ready.v.shape[0]
        self.reports.append((ready.layer, ready.first_block, ready.end_block))
        self.steps.append(self.step_counter[0] if self.step_counter else -1)
        dst = self.dst[ready.first_block : ready.end_block]
        self.decode.kv_importer.write(ready.request_id, ready.layer, dst, ready.k, ready.v)

    def assert_each_block_once_per_layer(self, num_layers: int, num_prompt_tokens: int) -> None:
        for layer in range(num_layers):
            covered = [b for rep_layer, first, end in self.reports if rep_layer == layer for b in range(first, end)]
            assert covered == list(range(blocks_for_tokens(num_prompt_tokens, BLOCK))), (layer, self.reports)


def prefill_params(params: SamplingParams) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, stop=list(params.stop))


def drain(engine, limit: int = 1000) -> list:
    outputs = []
    for _ in range(limit):
        if not engine.has_unfinished():
            return outputs
        outputs += engine.step()
    raise AssertionError("the engine did not finish its requests")


def prefill_all(prefill, rids: list[str]) -> dict:
    firsts = {o.request_id: o for o in drain(prefill)}
    assert sorted(firsts) == sorted(rids)
    for out in firsts.values():
        assert out.error is None and out.finish_reason == FinishReason.PREFILLED and len(out.new_token_ids) == 1
        assert prefill.requests[out.request_id].status == RequestStatus.PREFILLED
    return firsts


def client_view(first, outputs: list, rid: str) -> tuple[list[int], str, str]:
    """What the client gets: the prefill worker's first token and text, then the decode engine's outputs."""
    ids, text, reason = list(first.new_token_ids), first.text_delta, None
    for out in outputs:
        if out.request_id == rid:
            assert out.error is None and reason is None
            ids += out.new_token_ids
            text += out.text_delta
            reason = out.finish_reason
    assert reason is not None
    return ids, text, reason.value


def handoff(prefill, decode, prompts: list[list[int]], params: SamplingParams, stream: bool, tag: str = "r") -> list:
    """Every prompt through prefill (together: batched, chunked) and into decode via the connector; per prompt,
    what the client gets."""
    rids, wires = [f"{tag}{i}" for i in range(len(prompts))], {}
    for rid, prompt in zip(rids, prompts):
        dst = decode.kv_importer.reserve(prompt, copy(params), rid)
        wires[rid] = Wire(decode, dst)
        prefill.add_request(
            prompt, prefill_params(params), rid, prefill_only=True, kv_sink=wires[rid], stream_kv=stream
        )
    firsts = prefill_all(prefill, rids)
    for rid, prompt in zip(rids, prompts):
        wires[rid].assert_each_block_once_per_layer(prefill.kv_spec.num_layers, len(prompt))
        prefill.release(rid)
        decode.kv_importer.tokens_in(rid, [firsts[rid].new_token_ids[0]])
        assert decode.kv_importer.kv_done(rid)
    outputs = drain(decode)
    return [client_view(firsts[rid], outputs, rid) for rid in rids]


def expected(single, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str]:
    [result] = single.generate([prompt], copy(params))
    return result.token_ids, result.text, result.finish_reason


def no_leaks(*engines) -> None:
    for engine in engines:
        assert not engine.has_unfinished()
        engine.check_no_leaks()


# ---- token-exact hand-off ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_batch_tokens", [2048, 24], ids=["whole", "chunked"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
def test_handoff_equals_generate(tiny_llama_path, make_engine, stream, max_batch_tokens):
    single = make_engine(tiny_llama_path)
    prefill = make_engine(tiny_llama_path, max_batch_tokens=max_batch_tokens)
    decode = make_engine(tiny_llama_path)
    decode.generate([[7, 8, 9] * 20], greedy(3))  # shift decode's free list: physical ids differ from prefill's
    # mid-block, one token, exactly one block, on a block boundary, several blocks
    prompts = [p[:n] for p, n in zip(random_prompts(6, 100, 100, seed=21), [37, 1, 16, 48, 100, 23])]
    params = greedy(14)
    want = [expected(single, p, params) for p in prompts]
    assert handoff(prefill, decode, prompts, params, stream) == want
    # again: the prefill engine now serves the prompts' full blocks from its prefix cache, and still reports them
    hits = prefill.block_manager.prefix_hit_tokens
    assert handoff(prefill, decode, prompts, params, stream, tag="again") == want
    assert prefill.block_manager.prefix_hit_tokens > hits
    no_leaks(single, prefill, decode)


def test_handoff_text_with_stop_strings_and_one_token(tiny_qwen2_path, make_engine):
    single, prefill, decode = (make_engine(tiny_qwen2_path) for _ in range(3))
    [prompt] = random_prompts(1, 30, 30, seed=22)
    [free] = single.generate([prompt], greedy(30))
    stop = _spanning_stop(single.tokenizer, free.token_ids, free.text)
    for n, params in enumerate([greedy(30), greedy(1), greedy(30, stop=[stop])]):
        [got] = handoff(prefill, decode, [prompt], params, stream=True, tag=f"t{n}-")
        assert got == expected(single, prompt, params)
    no_leaks(single, prefill, decode)


def test_streamed_reports_follow_the_chunks_inside_the_forward(tiny_llama_path, make_engine):
    prefill = make_engine(tiny_llama_path, max_batch_tokens=32)
    decode = make_engine(tiny_llama_path)
    num_layers = prefill.kv_spec.num_layers
    # chunks end at 32, 64, 96, 128, 150: 9 full blocks + 1 partial; two prompts, so no prefix cache hit
    prompts = random_prompts(2, 150, 150, seed=23)
    events: list[tuple] = []
    prefill.set_layer_hook(lambda layer, batch: events.append(("layer", layer)))
    for stream, prompt in zip((True, False), prompts):
        events.clear()
        step = [0]
        dst = decode.kv_importer.reserve(prompt, greedy(2), "p")
        wire = Wire(decode, dst, step)

        def sink(ready: KVBlocksReady, wire: Wire = wire) -> None:
            events.append(("kv", ready.layer))
            wire(ready)

        prefill.add_request(prompt, prefill_params(greedy()), "p", prefill_only=True, kv_sink=sink, stream_kv=stream)
        first = []
        while not first:
            first = prefill.step()
            step[0] += 1
        assert step[0] == 5
        wire.assert_each_block_once_per_layer(num_layers, len(prompt))
        if stream:  # each forward: every layer reports the blocks it completed, right after writing its KV
            ranges = [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
            assert wire.reports == [(layer, *r) for r in ranges for layer in range(num_layers)]
            assert wire.steps == [s for s in range(5) for _ in range(num_layers)]
            assert events == [
                e for _ in range(5) for layer in range(num_layers) for e in (("kv", layer), ("layer", layer))
            ]
        else:  # the whole prompt, every layer, once the prompt is done (after its last forward)
            assert wire.reports == [(layer, 0, 10) for layer in range(num_layers)]
            assert wire.steps == [4] * num_layers
            assert events[-num_layers:] == [("kv", layer) for layer in range(num_layers)]
        prefill.release("p")
        decode.abort("p")
    prefill.set_layer_hook(None)
    no_leaks(prefill, decode)


# ---- decode side: admission, recompute, failure, expiry, abort -----------------------------------------------------


def _prefilled(prefill, decode, prompt: list[int], params: SamplingParams, rid: str, write: bool = True):
    """Reserve on decode, prefill with a wire (or a sink that drops everything), release; returns the first output."""
    dst = decode.kv_importer.reserve(prompt, copy(params), rid)
    sink = Wire(decode, dst) if write else (lambda ready: None)
    prefill.add_request(prompt, prefill_params(params), rid, prefill_only=True, kv_sink=sink)
    [first] = prefill_all(prefill, [rid]).values()
    prefill.release(rid)
    return first


@pytest.mark.parametrize("order", ["kv_first", "token_first"])
def test_admission_waits_for_kv_and_first_token(tiny_llama_path, make_engine, order):
    single, prefill, decode = (make_engine(tiny_llama_path) for _ in range(3))
    prompt, other = random_prompts(2, 40, 60, seed=24)
    params = greedy(10)
    first = _prefilled(prefill, decode, prompt, params, "x")
    decode.add_request(other, greedy(12), "other")  # decoding already: "x" joins the running batch between steps
    outputs = decode.step() + decode.step()
    arrivals = [
        lambda: decode.kv_importer.kv_done("x"),
        lambda: decode.kv_importer.tokens_in("x", [first.new_token_ids[0]]),
    ]
    if order == "token_first":
        arrivals.reverse()
    arrivals[0]()
    time.sleep(0.002)  # so that the wait for the second half is measurable
    for _ in range(2):  # one half in: never admitted
        outputs += decode.step()
        assert decode.requests["x"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert all(o.request_id == "other" for o in outputs)
    arrivals[1]()
    assert decode.has_unfinished()
    step = decode.step()
    admitted = [o for o in step if o.request_id == "x"]
    # admitted and decoded in the same step: one output, the second token (the first was sent by prefill)
    assert [o.new_token_ids for o in admitted] == [[expected(single, prompt, params)[0][1]]]
    outputs += step + drain(decode)
    assert client_view(first, outputs, "x") == expected(single, prompt, params)
    assert client_view(outputs[0], outputs[1:], "other") == expected(single, other, greedy(12))
    timing, handoff = admitted[0].timing, admitted[0].kv_import
    assert handoff is not None and handoff.admitted_s is not None and handoff.first_decode_s is not None
    assert handoff.state is ImportState.READY and handoff.tokens == [first.new_token_ids[0]]
    assert handoff.kv_transfer_s == handoff.kv_done_s - handoff.expected_s and handoff.kv_transfer_s > 0
    if order == "kv_first":
        assert handoff.kv_wait_after_first_token_s == 0.0
    else:
        assert handoff.kv_wait_after_first_token_s >= 0.002
    assert handoff.decode_queue_s is not None and handoff.decode_queue_s >= 0 and not handoff.recomputed
    x_outputs = [o for o in outputs if o.request_id == "x"]
    assert all(o.timing is timing and o.kv_import is handoff for o in x_outputs)  # the live records, not copies
    assert first.timing.queue_s >= 0 and first.timing.compute_s > 0  # the prefill side's figures
    no_leaks(single, prefill, decode)


def test_admission_can_finish_at_once(tiny_llama_path, make_engine):
    single, prefill, decode = (make_engine(tiny_llama_path) for _ in range(3))
    [prompt] = random_prompts(1, 33, 33, seed=25)
    params = greedy(1)
    first = _prefilled(prefill, decode, prompt, params, "one")
    decode.kv_importer.tokens_in("one", [first.new_token_ids[0]])
    decode.kv_importer.kv_done("one")
    [out] = decode.step()
    assert out.finished and out.finish_reason == FinishReason.LENGTH and out.new_token_ids == []
    assert client_view(first, [out], "one") == expected(single, prompt, params)
    assert out.kv_import.decode_queue_s is not None and out.kv_import.first_decode_s is None
    no_leaks(single, prefill, decode)


@pytest.mark.parametrize("when", ["before_first_token", "after_first_token"])
def test_recompute_after_a_failed_transfer_is_token_exact(tiny_llama_path, make_engine, when):
    single, prefill, decode = (make_engine(tiny_llama_path) for _ in range(3))
    [prompt] = random_prompts(1, 45, 45, seed=26)
    params = greedy(10)
    first = _prefilled(prefill, decode, prompt, params, "x", write=False)
    # half a transfer of garbage lands in the reserved blocks: the recompute must not use any of it
    dst = decode.requests["x"].block_ids[:2]
    shape = (2, *decode.kv_cache.k[0].shape[1:])
    decode.kv_importer.write("x", 0, dst, torch.randn(shape), torch.randn(shape))
    if when == "after_first_token":
        decode.kv_importer.tokens_in("x", [first.new_token_ids[0]])
    assert decode.kv_importer.kv_failed("x", recompute=True)
    assert decode.num_free_blocks == decode.block_manager.num_blocks  # freed at once, not held until admission
    with pytest.raises(ValueError):
        decode.kv_importer.kv_done("x")  # that transfer has ended
    if when == "before_first_token":
        assert not decode.has_unfinished() and decode.step() == []
        decode.kv_importer.tokens_in("x", [first.new_token_ids[0]])
    outputs = drain(decode)
    assert client_view(first, outputs, "x") == expected(single, prompt, params)
    assert decode.num_recomputes == 1
    handoff = outputs[0].kv_import
    assert handoff.recomputed and handoff.kv_transfer_s is None and handoff.state is ImportState.RECOMPUTE
    assert handoff.decode_queue_s >= 0
    no_leaks(single, prefill, decode)


@pytest.mark.parametrize("when", ["before_first_token", "after_first_token"])
def test_a_failed_transfer_without_recompute_frees_the_request(tiny_llama_path, make_engine, when):
    prefill, decode = make_engine(tiny_llama_path), make_engine(tiny_llama_path)
    [prompt] = random_prompts(1, 45, 45, seed=27)
    first = _prefilled(prefill, decode, prompt, greedy(), "x", write=False)
    if when == "after_first_token":
        decode.kv_importer.tokens_in("x", [first.new_token_ids[0]])
    assert decode.kv_importer.kv_failed("x", recompute=False)
    assert "x" not in decode.requests and decode.num_free_blocks == decode.block_manager.num_blocks
    assert not decode.has_unfinished() and decode.step() == []  # no output: the caller reports the cause
    assert decode.num_recomputes == 0
    # late news about it is ignored, or refused where the caller must know it is gone
    assert decode.kv_importer.kv_done("x") is False and decode.kv_importer.kv_failed("x", recompute=True) is False
    with pytest.raises(KeyError):
        decode.kv_importer.tokens_in("x", [first.new_token_ids[0]])
    with pytest.raises(KeyError):
        decode.kv_importer.write("x", 0, [0], torch.zeros(1, 1), torch.zeros(1, 1))
    no_leaks(prefill, decode)


def test_write_remote_kv_lands_only_in_the_requests_reserved_prompt_blocks(tiny_llama_path, make_engine):
    decode = make_engine(tiny_llama_path)
    a = decode.kv_importer.reserve(list(range(40)), greedy(), "a", headroom_tokens=32)  # 3 prompt blocks + headroom
    b = decode.kv_importer.reserve(list(range(20)), greedy(), "b")
    shape = (1, *decode.kv_cache.k[0].shape[1:])
    k, v = torch.ones(shape), torch.ones(shape)
    for stray in ([b[0]], [a[3]]):  # another request's block; a headroom block (no prompt KV goes there)
        with pytest.raises(ValueError):
            decode.kv_importer.write("a", 0, stray, k, v)
        assert decode.kv_cache.k[0][stray[0]].abs().sum() == 0
    decode.kv_importer.write("a", 1, [a[2]], k, v)
    assert torch.equal(decode.kv_cache.k[1][a[2]], k[0])
    decode.abort("a")
    decode.abort("b")
    no_leaks(decode)


def test_expire_remote_frees_reservations_without_a_first_token(tiny_llama_path, make_engine):
    single, prefill, decode = (make_engine(tiny_llama_path) for _ in range(3))
    prompt, other = random_prompts(2, 30, 50, seed=28)
    params = greedy(8)
    first = _prefilled(prefill, decode, prompt, params, "kept")
    decode.kv_importer.reserve(other, greedy(), "lost")
    decode.kv_importer.tokens_in("kept", [first.new_token_ids[0]])
    time.sleep(0.01)
    assert decode.kv_importer.expire(3600.0) == []
    assert decode.kv_importer.expire(0.0) == ["lost"]
    assert "lost" not in decode.requests and decode.kv_importer.expire(0.0) == []
    assert decode.kv_importer.kv_done("kept")  # the one with its first token goes on
    assert client_view(first, drain(decode), "kept") == expected(single, prompt, params)
    no_leaks(single, prefill, decode)


ABORT_STATES = [
    "reserved",
    "first_token_in",
    "kv_in",
    "ready",
    "failed_to_recompute",
    "failed_and_ready",
    "recomputing",
    "prefill_streaming",
    "prefilled",
]


@pytest.mark.parametrize("state", ABORT_STATES)
def test_abort_works_in_every_state_of_the_handoff(tiny_llama_path, make_engine, state):
    prefill = make_engine(tiny_llama_path, max_batch_tokens=32)
    decode = make_engine(tiny_llama_path)
    [prompt] = random_prompts(1, 100, 100, seed=29)
    dst = decode.kv_importer.reserve(prompt, greedy(), "x")
    wire = Wire(decode, dst)
    prefill.add_request(prompt, prefill_params(greedy()), "x", prefill_only=True, kv_sink=wire)
    if state == "prefill_streaming":
        prefill.step()  # one chunk of four: two blocks reported, every layer
        reported = [(layer, 0, 2) for layer in range(prefill.kv_spec.num_layers)]
        assert wire.reports == reported and prefill.requests["x"].kv_export.num_blocks_reported == 2
        assert prefill.abort("x") and decode.abort("x")
        assert drain(prefill) == [] and wire.reports == reported  # nothing more after the abort
        no_leaks(prefill, decode)
        return
    [first] = prefill_all(prefill, ["x"]).values()
    if state == "prefilled":
        assert prefill.abort("x") and decode.abort("x")
        no_leaks(prefill, decode)
        return
    prefill.release("x")
    token = first.new_token_ids[0]
    steps = {
        "reserved": [],
        "first_token_in": [lambda: decode.kv_importer.tokens_in("x", [token])],
        "kv_in": [lambda: decode.kv_importer.kv_done("x")],
        "ready": [lambda: decode.kv_importer.kv_done("x"), lambda: decode.kv_importer.tokens_in("x", [token])],
        "failed_to_recompute": [lambda: decode.kv_importer.kv_failed("x", recompute=True)],
        "failed_and_ready": [
            lambda: decode.kv_importer.kv_failed("x", recompute=True),
            lambda: decode.kv_importer.tokens_in("x", [token]),
        ],
        "recomputing": [
            lambda: decode.kv_importer.kv_failed("x", recompute=True),
            lambda: decode.kv_importer.tokens_in("x", [token]),
            decode.step,
        ],
    }[state]
    for action in steps:
        action()
    assert decode.has_unfinished() == (state in ("ready", "failed_and_ready", "recomputing"))
    assert decode.abort("x") and not decode.abort("x")
    assert decode.step() == [] and not decode.has_unfinished()
    no_leaks(prefill, decode)


# ---- faults and the block count ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
def test_a_raising_sink_fails_only_its_steps_requests(tiny_llama_path, make_engine, stream):
    single = make_engine(tiny_llama_path)
    engine = make_engine(tiny_llama_path, max_num_seqs=2)
    decoding, exported, waiting = random_prompts(3, 20, 40, seed=30)
    params = greedy(8)

    def sink(ready: KVBlocksReady) -> None:
        raise RuntimeError("link down")

    engine.add_request(decoding, greedy(8), "decoding")
    outputs = engine.step() + engine.step()  # "decoding" is past its prefill
    engine.add_request(exported, prefill_params(params), "exported", prefill_only=True, kv_sink=sink, stream_kv=stream)
    engine.add_request(waiting, greedy(8), "waiting")  # max_num_seqs: not in the failing step
    failed = engine.step()
    errors = {o.request_id: o for o in failed if o.error is not None}
    expect_failed = {"decoding", "exported"} if stream else {"exported"}  # streamed: inside the forward
    assert set(errors) == expect_failed
    for out in errors.values():
        assert out.finished and out.finish_reason == FinishReason.ERROR and out.error_code == "worker_error"
        assert "link down" in out.error and out.timing is not None
    outputs += [o for o in failed if o.error is None] + drain(engine)
    if not stream:
        assert client_view(outputs[0], outputs[1:], "decoding") == expected(single, decoding, greedy(8))
    waiting_out = [o for o in outputs if o.request_id == "waiting"]
    assert client_view(waiting_out[0], waiting_out[1:], "waiting") == expected(single, waiting, greedy(8))
    no_leaks(single, engine)


def test_reserved_blocks_is_what_the_importer_reserves(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, max_model_len=80, kv_blocks=64)
    cases = [
        (1, 1, 0),
        (15, 16, 0),
        (16, 16, 0),
        (17, 2, 100),
        (20, 100, 64),
        (20, 4, 64),
        (60, 100, 100),
        (79, 50, 10),
        (32, 1, 500),
        (47, 3, 1),
    ]
    for n, (num_prompt, max_tokens, headroom) in enumerate(cases):
        blocks = engine.kv_importer.reserve(list(range(1, num_prompt + 1)), greedy(max_tokens), f"c{n}", headroom)
        assert blocks is not None
        assert len(blocks) == reserved_blocks(num_prompt, max_tokens, headroom, BLOCK, max_model_len=80), (n, blocks)
        assert engine.abort(f"c{n}")
    # without max_model_len (the router's view): the cap is what the request can generate
    assert reserved_blocks(20, 100, 64, BLOCK) == blocks_for_tokens(20 + 1 + 64, BLOCK) == 6
    assert reserved_blocks(20, 4, 64, BLOCK) == blocks_for_tokens(20 + 4, BLOCK) == 2
    assert [engine.block_manager.blocks_for(n) for n in range(50)] == [blocks_for_tokens(n, BLOCK) for n in range(50)]
    no_leaks(engine)


# ---- prefix reuse across the hand-off, and prefill on the decode engine ----------------------------------------------


def _turn(prefill, decode, prompt: list[int], params: SamplingParams, rid: str, stream: bool = True):
    """One hand-off in which the decode engine reuses what its prefix cache holds: the reservation shares those blocks,
    the prefill engine reports only the blocks after them. Returns (what the client gets, the wire, cached tokens)."""
    dst = decode.kv_importer.reserve(prompt, copy(params), rid, prefix_cache=True)
    cached = decode.requests[rid].num_cached_tokens
    wire = Wire(decode, dst)
    prefill.add_request(
        prompt, prefill_params(params), rid, prefill_only=True, kv_sink=wire, stream_kv=stream, export_from_token=cached
    )
    [first] = prefill_all(prefill, [rid]).values()
    prefill.release(rid)
    decode.kv_importer.tokens_in(rid, [first.new_token_ids[0]])
    assert decode.kv_importer.kv_done(rid)
    return client_view(first, drain(decode), rid), wire, cached


@pytest.mark.parametrize("max_batch_tokens", [2048, 24], ids=["whole", "chunked"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "unstreamed"])
def test_a_chats_next_turn_reuses_the_decode_engines_history(tiny_llama_path, make_engine, stream, max_batch_tokens):
    single = make_engine(tiny_llama_path)
    prefill = make_engine(tiny_llama_path, max_batch_tokens=max_batch_tokens)
    decode = make_engine(tiny_llama_path)
    num_layers = prefill.kv_spec.num_layers
    history, *user_turns = random_prompts(3, 21, 41, seed=60)
    params = greedy(23)
    for turn, user in enumerate([[], *user_turns]):
        prompt = history + user
        got, wire, cached = _turn(prefill, decode, prompt, params, f"turn{turn}", stream)
        assert got == expected(single, prompt, params), turn
        # the decode engine held every full block of the history it decoded (its generated tokens too, all but the
        # last, whose KV is never computed); the prefill engine held only the prompts it computed
        assert cached == (0 if turn == 0 else (len(history) - 1) // BLOCK * BLOCK)
        first, end = cached // BLOCK, blocks_for_tokens(len(prompt), BLOCK)
        assert first < end if turn == 0 else 0 < first < end  # later turns: fewer blocks travel, never none
        for layer in range(num_layers):  # only the missing blocks travel, each once per layer
            covered = sorted(b for lyr, a, z in wire.reports if lyr == layer for b in range(a, z))
            assert covered == list(range(first, end)), (turn, layer)
        history = prompt + got[0]
    assert decode.block_manager.prefix_hit_tokens > 0
    no_leaks(single, prefill, decode)


def test_write_remote_kv_refuses_the_shared_prefix_blocks(tiny_llama_path, make_engine):
    decode = make_engine(tiny_llama_path)
    history = random_prompts(1, 40, 40, seed=61)[0]
    [done] = decode.generate([history], greedy(30))  # its blocks stay cached, generated tokens included
    prompt = history + done.token_ids + [5, 6, 7]
    dst = decode.kv_importer.reserve(prompt, greedy(), "x", prefix_cache=True)
    cached = decode.requests["x"].num_cached_tokens
    assert cached == (40 + 30 - 1) // BLOCK * BLOCK == 64  # never the whole prompt: its last block is computed
    assert decode.kv_importer.expected_blocks(decode.requests["x"]) == dst[4:5]
    shape = (1, *decode.kv_cache.k[0].shape[1:])
    before = decode.kv_cache.k[0][dst[0]].clone()
    with pytest.raises(ValueError, match="not reserved"):  # shared with the cache: another request may read it
        decode.kv_importer.write("x", 0, [dst[0]], torch.ones(shape), torch.ones(shape))
    assert torch.equal(decode.kv_cache.k[0][dst[0]], before)
    decode.kv_importer.write("x", 0, [dst[4]], torch.ones(shape), torch.ones(shape))
    assert decode.abort("x")
    # without prefix_cache (the default): every block is reserved anew, as before
    assert decode.kv_importer.reserve(prompt, greedy(), "y") is not None and decode.requests["y"].num_cached_tokens == 0
    assert decode.abort("y")
    no_leaks(decode)


def test_export_from_token_must_be_whole_blocks_inside_the_prompt(tiny_llama_path, make_engine):
    prefill = make_engine(tiny_llama_path)
    prompt = list(range(1, 41))
    for bad in (8, 40, 48, -16):
        with pytest.raises(ValueError, match="export_from_token"):
            prefill.add_request(
                prompt, greedy(1), "x", prefill_only=True, kv_sink=lambda r: None, export_from_token=bad
            )
    with pytest.raises(ValueError, match="needs a kv_sink"):
        prefill.add_request(prompt, greedy(1), "x", prefill_only=True, export_from_token=16)
    assert not prefill.requests
    no_leaks(prefill)


@pytest.mark.parametrize("max_batch_tokens", [2048, 8], ids=["whole", "chunked"])
def test_prefill_here_computes_a_reservation_on_the_decode_engine(tiny_llama_path, make_engine, max_batch_tokens):
    single = make_engine(tiny_llama_path)
    decode = make_engine(tiny_llama_path, max_batch_tokens=max_batch_tokens)
    history, other = random_prompts(2, 35, 35, seed=62)
    [done] = decode.generate([history], greedy(20))
    params = greedy(9)
    decode.add_request(other, greedy(20), "other")  # decoding already: the local prefills join the running batch
    outputs = decode.step()
    for rid, prompt in (("cold", list(reversed(other))), ("warm", history + done.token_ids + [9, 8, 7])):
        decode.kv_importer.reserve(prompt, copy(params), rid, prefix_cache=True)
        request = decode.requests[rid]
        assert request.num_cached_tokens == (0 if rid == "cold" else (35 + 20 - 1) // BLOCK * BLOCK)
        decode.kv_importer.prefill_here(rid)
        assert request.status == RequestStatus.RUNNING and request.kv_import is None
        assert request.num_computed_tokens == request.num_cached_tokens
        outputs += drain(decode)
        mine = [o for o in outputs if o.request_id == rid]
        # the first token is sampled here: its output carries it and its text, like any request's
        assert mine[0].new_token_ids and mine[0].num_output_tokens == 1
        assert client_view(mine[0], mine[1:], rid) == expected(single, prompt, params), rid
        assert mine[0].timing.queue_s >= 0 and mine[0].timing.compute_s > 0 and mine[0].kv_import is None
    theirs = [o for o in outputs if o.request_id == "other"]
    assert client_view(theirs[0], theirs[1:], "other") == expected(single, other, greedy(20))
    no_leaks(single, decode)


def test_prefill_here_only_for_an_untouched_reservation_and_abort_frees_it(tiny_llama_path, make_engine):
    decode = make_engine(tiny_llama_path, max_batch_tokens=16)
    [prompt] = random_prompts(1, 60, 60, seed=63)
    with pytest.raises(KeyError):
        decode.kv_importer.prefill_here("nobody")
    decode.kv_importer.reserve(prompt, greedy(), "started")
    decode.kv_importer.tokens_in("started", [3])  # its KV comes from a prefill worker: too late to compute it here
    with pytest.raises(ValueError, match="already taking its KV"):
        decode.kv_importer.prefill_here("started")
    assert decode.requests["started"].status == RequestStatus.WAITING_FOR_REMOTE_KV
    decode.kv_importer.reserve(prompt, greedy(), "local")
    decode.kv_importer.prefill_here("local")
    with pytest.raises(ValueError):
        decode.kv_importer.prefill_here("local")  # no longer a reservation
    decode.step()  # one chunk of four
    assert decode.requests["local"].num_computed_tokens == 16
    assert decode.abort("local") and decode.abort("started")
    assert decode.step() == [] and not decode.has_unfinished()
    no_leaks(decode)


def test_a_prefilled_requests_held_kv_exports_again_whole_as_it_streamed(tiny_llama_path, make_engine):
    """A prefill-only request's KV, held after its hand-off, reads back whole (its last partial block too): it can be
    sent again (as ``pdserve bench tp-handoff``'s send-only run does), bit-identical to what streamed out."""
    engine = make_engine(tiny_llama_path)
    prompt = random_prompts(1, 40, 40, seed=3)[0]
    streamed: list[KVBlocksReady] = []
    rid = engine.add_request(prompt, greedy(), prefill_only=True, kv_sink=streamed.append)
    with pytest.raises(ValueError, match="not held for export"):  # waiting: no KV yet
        engine.kv_exporter.export_held(engine.requests[rid], streamed.append, 0, 1, range(1))
    while engine.requests[rid].status is not RequestStatus.PREFILLED:
        engine.step()
    request, layers = engine.requests[rid], range(engine.kv_spec.num_layers)
    end = blocks_for_tokens(len(prompt), BLOCK)
    held: list[KVBlocksReady] = []
    engine.kv_exporter.export_held(request, held.append, 0, end, layers)
    assert [(r.layer, r.first_block, r.end_block) for r in held] == [(layer, 0, end) for layer in layers]
    for layer in layers:
        pieces = [r for r in streamed if r.layer == layer]
        k = torch.cat([r.k for r in pieces])
        v = torch.cat([r.v for r in pieces])
        assert torch.equal(held[layer].k, k) and torch.equal(held[layer].v, v)
    with pytest.raises(ValueError, match="has not filled"):
        engine.kv_exporter.export_held(request, held.append, 0, end + 1, layers)
    engine.release(rid)
    engine.check_no_leaks()
