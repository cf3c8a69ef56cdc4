"""Engine test helpers: random prompts and the reference every greedy output is compared with."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM


class Reference:
    """transformers' own greedy ``generate``, one prompt at a time (no padding): the ground truth."""

    def __init__(self, path, attn_implementation: str = "sdpa") -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn_implementation
        ).eval()

    @torch.inference_mode()
    def greedy(self, token_ids: list[int], max_new_tokens: int) -> list[int]:
        input_ids = torch.tensor([token_ids])
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=self.model.config.pad_token_id or 0,
        )
        return out[0, len(token_ids) :].tolist()


def random_prompts(count: int, min_len: int, max_len: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def handoff(prefill, decode, prompt, params, request_id: str) -> list:
    """One request through the prefill/decode hand-off as the workers do it: a reservation on ``decode``, a
    prefill-only copy (max_tokens 1, as the prefill worker sets) on ``prefill`` whose KV sink writes into the
    reserved blocks, then the first token and KV done. Returns every output the client's stream is made of: the
    prefill engine's first one, then the decode engine's (its admission output included)."""
    from engine.kv_connector import KVBlocksReady

    dst_blocks = decode.kv_importer.reserve(prompt, params.copy(), request_id)
    assert dst_blocks is not None

    def sink(ready: KVBlocksReady) -> None:
        decode.kv_importer.write(
            ready.request_id, ready.layer, dst_blocks[ready.first_block : ready.end_block], ready.k, ready.v
        )

    first_params = params.copy()
    first_params.max_tokens = 1
    prefill.add_request(prompt, first_params, request_id, prefill_only=True, kv_sink=sink)
    outputs = [o for _ in range(100) if prefill.has_unfinished() for o in prefill.step()]
    [first] = outputs
    prefill.release(request_id)
    if first.finish_reason is not None and first.finish_reason.value == "error":
        decode.abort(request_id)
        return outputs
    decode.kv_importer.tokens_in(request_id, [first.new_token_ids[0]])
    assert decode.kv_importer.kv_done(request_id)
    while decode.has_unfinished():
        outputs += [o for o in decode.step() if o.request_id == request_id]
    return outputs
