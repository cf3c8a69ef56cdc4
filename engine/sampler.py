"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a per-request generator.

Greedy rows are one batched argmax. Sampled rows go one by one, each with the request's own ``torch.Generator``, so a
request with a seed draws the same tokens whatever else shares its batch.
"""

from __future__ import annotations

import torch

from engine.request import Request


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """``logits`` is float32 ``[len(requests), vocab]``; returns one token id per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, req in enumerate(requests):
        params = req.params
        if params.greedy:
            continue
        scores = logits[row] / params.temperature
        if params.top_k > 0 and params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            probs = torch.softmax(sorted_scores, dim=-1)
            # drop a token when the tokens ranked above it already cover top_p; the first token always stays
            drop = (probs.cumsum(dim=-1) - probs) >= params.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if req.generator is None:
            req.generator = make_generator(params.seed, logits.device)
        tokens[row] = int(torch.multinomial(probs, 1, generator=req.generator))
    return tokens
