"""The prefill/decode hand-off in miniature: KV exported from one engine, imported into another, decoded there."""

from __future__ import annotations

from engine.kv_connector import KVBlocksReady
from engine.request import RequestStatus, SamplingParams
from tests.helpers.engine import random_prompts


def _handoff(prefill, decode, prompt: list[int], params: SamplingParams, request_id: str) -> list[int]:
    """Reserve on decode, prefill with a KV sink that writes each reported block range into the reserved blocks,
    then the first token; returns every token the client gets (prefill's first, then decode's)."""
    dst_blocks = decode.kv_importer.reserve(prompt, params, request_id)
    num_src_blocks = -(-len(prompt) // prefill.kv_spec.block_size)
    assert dst_blocks is not None and len(dst_blocks) >= num_src_blocks

    def sink(ready: KVBlocksReady) -> None:
        dst = dst_blocks[ready.first_block : ready.end_block]
        decode.kv_importer.write(ready.request_id, ready.layer, dst, ready.k, ready.v)

    prefill.add_request(
        prompt, SamplingParams(max_tokens=1, temperature=0.0), request_id, prefill_only=True, kv_sink=sink
    )
    [first] = [o for _ in range(10) for o in prefill.step()]
    assert first.finished and prefill.requests[request_id].status == RequestStatus.PREFILLED
    assert prefill.requests[request_id].kv_export.num_blocks_reported == num_src_blocks
    prefill.release(request_id)

    decode.kv_importer.tokens_in(request_id, [first.new_token_ids[0]])
    assert decode.kv_importer.kv_done(request_id)
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        tokens += [t for o in decode.step() if o.request_id == request_id for t in o.new_token_ids]
    return tokens


def test_exported_kv_decodes_to_the_same_tokens(tiny_llama_path, make_engine):
    single = make_engine(tiny_llama_path)
    prefill = make_engine(tiny_llama_path)
    decode = make_engine(tiny_llama_path)
    decode.generate([[1, 2, 3] * 20], SamplingParams(max_tokens=3))  # shift decode's free list: fresh block ids
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(3, 20, 120, seed=11)):
        [expected] = single.generate([prompt], params)
        assert _handoff(prefill, decode, prompt, params, f"req-{i}") == expected.token_ids


def test_handoff_of_a_chunked_prompt(tiny_qwen2_path, make_engine):
    single = make_engine(tiny_qwen2_path)
    prefill = make_engine(tiny_qwen2_path, max_batch_tokens=32)
    decode = make_engine(tiny_qwen2_path)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    [prompt] = random_prompts(1, 150, 150, seed=12)
    [expected] = single.generate([prompt], params)
    assert _handoff(prefill, decode, prompt, params, "long") == expected.token_ids


def test_reservation_refused_when_blocks_are_short(tiny_llama_path, make_engine):
    decode = make_engine(tiny_llama_path, kv_blocks=8)
    assert decode.kv_importer.reserve(list(range(100)), SamplingParams(), "a") is not None  # 7 blocks
    assert decode.kv_importer.reserve(list(range(40)), SamplingParams(), "b") is None  # never overcommitted
    assert decode.abort("a")
    assert decode.num_free_blocks == 8


def test_reservation_refused_at_max_num_seqs(tiny_llama_path, make_engine):
    """A decode engine holds at most max_num_seqs requests, so no decode step has more rows than the batch the gather
    buffer and the KV plan are sized for; a freed slot takes the next reservation."""
    decode = make_engine(tiny_llama_path, max_num_seqs=2)
    assert decode.kv_importer.reserve([1, 2, 3], SamplingParams(), "a") is not None
    assert decode.kv_importer.reserve([4, 5, 6], SamplingParams(), "b") is not None
    assert decode.at_seq_limit()
    assert decode.kv_importer.reserve([7, 8, 9], SamplingParams(), "c") is None
    assert "c" not in decode.requests
    assert decode.abort("a")
    assert decode.kv_importer.reserve([7, 8, 9], SamplingParams(), "c") is not None
    assert decode.abort("b") and decode.abort("c")


def test_layer_hook_sees_every_layer_in_order(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    seen: list[tuple[int, int]] = []
    engine.set_layer_hook(lambda layer, batch: seen.append((layer, len(batch.chunks))))
    engine.generate([[5] * 40], SamplingParams(max_tokens=2, temperature=0.0))
    layers = engine.kv_spec.num_layers
    assert [layer for layer, _ in seen] == list(range(layers)) * 2  # one prefill forward, one decode forward


def test_reservation_headroom_is_capped_by_what_the_request_can_generate(tiny_llama_path, make_engine):
    decode = make_engine(tiny_llama_path, kv_blocks=32)
    blocks = decode.kv_importer.reserve(list(range(20)), SamplingParams(max_tokens=100), "a", headroom_tokens=64)
    assert len(blocks) == -(-(20 + 1 + 64) // 16)
    short = decode.kv_importer.reserve(list(range(20)), SamplingParams(max_tokens=4), "b", headroom_tokens=64)
    assert len(short) == -(-(20 + 4) // 16)
    decode.abort("a")
    decode.abort("b")
