"""Next-token choice: greedy, or temperature / top-k / top-p sampling with a per-request generator.

Greedy rows are one batched argmax. Sampled rows go one by one, each with the request's own ``torch.Generator``, so a
request with a seed draws the same tokens whatever else shares its batch.

Every row is checked, and a bad row fails only its own request: logits that hold NaN or +inf (or are all -inf), or
probabilities that are not finite or leave nothing to draw after top-k / top-p, give that row an error instead of a
token. Nothing here raises for the batch (``torch.multinomial`` would, for one bad row, and on CUDA it would assert
on the device). The checks ride on the host transfers that exist anyway: one for the batched argmax and validity,
one at the end for every sampled token and its check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass(slots=True)
class SampleResult:
    """One entry per row: a token id and no error, or None and the reason that row could not be sampled."""

    token_ids: list[int | None]
    errors: list[str | None]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def sample(logits: torch.Tensor, requests: list[Request]) -> SampleResult:
    """``logits`` is float32 ``[len(requests), vocab]``; returns a token id or an error per row."""
    # NaN or +inf anywhere, or no finite logit at all, and the row is unusable whatever the sampling parameters
    finite = ~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1) & (logits.amax(dim=-1) > float("-inf"))
    greedy = torch.where(finite, logits.argmax(dim=-1), -1).tolist()  # one host transfer for the whole batch
    tokens: list[int | None] = [t if t >= 0 else None for t in greedy]
    errors: list[str | None] = [None if t >= 0 else "sampling failed: the logits are not finite" for t in greedy]
    drawn_rows: list[int] = []
    drawn: list[torch.Tensor] = []  # per sampled row: [token, 1 if its probabilities were usable]
    for row, req in enumerate(requests):
        if req.params.greedy or tokens[row] is None:
            continue
        if req.generator is None:
            req.generator = make_generator(req.params.seed, logits.device)
        drawn_rows.append(row)
        drawn.append(_draw(logits[row], req))
    if drawn:
        for row, (token, ok) in zip(drawn_rows, torch.stack(drawn).tolist()):
            if ok:
                tokens[row] = token
            else:
                tokens[row] = None
                errors[row] = (
                    f"sampling failed: the probabilities are not finite or leave nothing to sample "
                    f"(temperature={requests[row].params.temperature!r})"
                )
    return SampleResult(tokens, errors)


def _draw(row_logits: torch.Tensor, req: Request) -> torch.Tensor:
    """One sampled token for a row with finite logits, and whether its probabilities were usable, on the device."""
    params = req.params
    scores = row_logits / params.temperature
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
    # a division that overflowed (a huge logit over a small temperature) gives inf scores and NaN probabilities
    ok = torch.isfinite(probs).all() & (probs.sum() > 0)
    # multinomial raises (CPU) or asserts on the device (CUDA) for a bad row: draw from a harmless one instead
    safe = torch.where(ok, probs, torch.ones_like(probs))
    token = torch.multinomial(safe, 1, generator=req.generator)[0]
    return torch.stack([token, ok.to(token.dtype)])
