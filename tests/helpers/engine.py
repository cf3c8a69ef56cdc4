"""Engine test helpers: random prompts and the reference every greedy output is compared with."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM


class Reference:
    """transformers' own greedy ``generate``, one prompt at a time (no padding): the ground truth."""

    def __init__(self, path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()

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
