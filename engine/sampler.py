"""Next-token choice for a whole batch at once: logits processing, greedy or sampled tokens, and log probabilities.

Each row's parameters become tensors, so a step is a few batched ops whatever the mix; a stage runs only when some
row needs it. In vLLM's order: logprobs from the RAW logits (the model's own distribution, as OpenAI reports it);
logit_bias, penalties, min_tokens and the grammar make the PROCESSED logits; greedy rows take the argmax, sampled rows
apply temperature, min_p, top-k, top-p and draw ``argmax(probs / q)``, ``q ~ Exp(1)`` (no cumulative sums, and no
device assert on a bad row as in ``torch.multinomial``). A seeded row's ``q`` depends on (seed, output position)
alone, so prefill and decode workers together give the text one engine would. A bad row (NaN or +inf or all -inf
raw logits, or an unusable processed distribution) fails only its own request; results reach the host in one copy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from engine.host_values import long_tensor, to_device
from engine.request import Request, SamplingParams, TokenLogprob

_NEG_INF = float("-inf")
_MASK63 = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class PromptScores:
    """Prompt logprobs of one request from one forward, on the device (``ModelRunner.score_prompts``): entries
    ``first_entry ..`` of its ``prompt_logprobs`` (entry j scores prompt token j given the tokens before it)."""

    request: Request
    first_entry: int
    chosen: torch.Tensor  # [n] float32: logprob of the actual prompt token
    top_values: torch.Tensor  # [n, k] float32, most likely first
    top_ids: torch.Tensor  # [n, k] long


@dataclass(slots=True)
class SampleResult:
    """Per row a token id and no error, or None and why the row could not be sampled; ``logprobs[row]`` when its
    request asked for them; ``prompt_logprobs`` by request id, the prompt entries this step computed, in order."""

    token_ids: list[int | None]
    errors: list[str | None]
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


def seed_for_position(seed: int, position: int) -> int:
    """A 63-bit generator seed: splitmix64 of both, so neighbouring seeds or positions give unrelated streams."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64)) & _MASK63


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def logprob_summary(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """From float32 logprobs ``[n, vocab]``: the targets' values ``[n]`` and the top ``k`` (values, ids ``[n, k]``)."""
    chosen = logprobs.gather(1, targets.view(-1, 1)).view(-1)
    if k > 0:
        top = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)
        return chosen, top.values, top.indices
    empty = logprobs.new_empty(len(targets), 0)
    return chosen, empty, empty.long()


class Sampler:
    def __init__(self, eos_token_ids: Iterable[int] = (), device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = tuple(sorted(set(eos_token_ids)))
        self.generator = torch.Generator(device=device)  # unseeded rows: one stream for the engine
        self.generator.seed()
        self._seeded = torch.Generator(device=device)  # reseeded for every seeded row and position

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, requests: Sequence[Request], prompt_scores: Sequence[PromptScores] = ()
    ) -> SampleResult:
        """``logits``: float32 ``[len(requests), vocab]``, modified in place. One host transfer."""
        num_rows = len(requests)
        params = [r.params for r in requests]
        if num_rows == 0:  # a step of prompt chunks only: their prompt logprobs, if any
            none = torch.zeros(0, dtype=torch.bool, device=logits.device)
            return self._collect(none.long(), none, none, requests, [], None, prompt_scores)
        # NaN or +inf anywhere, or no finite logit at all, and the row is unusable whatever the sampling parameters
        finite = ~(torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1) & (logits.amax(dim=-1) > _NEG_INF)
        valid = finite
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None  # before any processing
        if self._process(logits, requests):
            valid = valid & (logits.amax(dim=-1) > _NEG_INF)  # a mask left nothing to choose from
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            drawn, ok = self._draw(logits, requests, sampled)
            if len(sampled) == num_rows:
                tokens, valid = drawn, valid & ok
            else:
                index = long_tensor(sampled, logits.device)
                tokens = tokens.index_copy(0, index, drawn)
                valid = valid.index_copy(0, index, valid[index] & ok)
        lp = None
        if raw_logprobs is not None:
            k = max(params[i].logprobs or 0 for i in lp_rows)
            index = long_tensor(lp_rows, logits.device)
            lp = logprob_summary(raw_logprobs, tokens[index], k)
        return self._collect(tokens, finite, valid, requests, lp_rows, lp, prompt_scores)

    # ---- logits processing ------------------------------------------------------------------------------------

    def _process(self, logits: torch.Tensor, requests: Sequence[Request]) -> bool:
        """min_tokens, logit_bias, penalties and grammar, in place, where used; True if any row changed (then it may
        have nothing left)."""
        vocab = logits.shape[-1]
        mask_rows: list[int] = []
        mask_cols: list[int] = []
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_values: list[float] = []
        penalized: list[int] = []
        grammar_rows: list[int] = []
        for row, req in enumerate(requests):
            p = req.params
            if p.min_tokens and len(req.output_token_ids) < p.min_tokens:
                banned = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids).union(self.eos_token_ids)
                ids = [t for t in banned if t < vocab]
                mask_rows += [row] * len(ids)
                mask_cols += ids
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_cols += list(p.logit_bias)
                bias_values += list(p.logit_bias.values())
            if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0:
                penalized.append(row)
            if req.grammar is not None:
                grammar_rows.append(row)
        device = logits.device
        if bias_rows:
            index = (_long(bias_rows, device), _long(bias_cols, device))
            logits.index_put_(index, to_device(bias_values, logits.dtype, device), accumulate=True)
        if penalized:
            _apply_penalties(logits, [requests[i] for i in penalized], penalized)
        if mask_rows:
            index = (_long(mask_rows, device), _long(mask_cols, device))
            logits.index_put_(index, logits.new_full((), _NEG_INF))
        if grammar_rows:
            from engine.structured import allocate_bitmask, apply_bitmask  # xgrammar: only for guided requests

            bitmask = allocate_bitmask(len(grammar_rows), vocab)
            for i, row in enumerate(grammar_rows):
                requests[row].grammar.fill_bitmask(bitmask, i)
            apply_bitmask(logits, bitmask, grammar_rows)
        return bool(mask_rows or bias_rows or penalized or grammar_rows)

    # ---- sampling ---------------------------------------------------------------------------------------------

    def _draw(
        self, logits: torch.Tensor, requests: Sequence[Request], rows: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled rows' tokens and whether each one's distribution was usable (both on the device)."""
        device = logits.device
        params = [requests[i].params for i in rows]
        scores = logits if len(rows) == len(requests) else logits[_long(rows, device)]
        temperature = to_device([p.temperature for p in params], scores.dtype, device)
        scores = scores / temperature.unsqueeze(1)  # a new tensor: the processed logits stay as they were
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], scores.dtype, device)
            probs = torch.softmax(scores, dim=-1)
            scores.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1), _NEG_INF)
        vocab = scores.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(top_k) or any(p.top_p < 1.0 for p in params):
            _top_k_top_p(scores, top_k, [p.top_p for p in params])
        probs = torch.softmax(scores, dim=-1)
        # a division that overflowed (a huge logit over a small temperature) gives inf scores and NaN probabilities
        ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        return (probs / self._exponential(probs, [requests[r] for r in rows])).argmax(dim=-1), ok

    def _exponential(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """``q ~ Exp(1)`` as ``-log(u)``, ``u ~ U[0, 1)`` (five times cheaper than ``exponential_`` on a CPU; u = 0
        gives q = inf, a token that cannot win, which has probability 0 anyway)."""
        seeded = [i for i, r in enumerate(requests) if r.params.seed is not None]
        if not seeded:
            return torch.rand(probs.shape, generator=self.generator, device=probs.device).log_().neg_()
        q = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        if unseeded:
            draw = torch.rand((len(unseeded), probs.shape[-1]), generator=self.generator, device=probs.device)
            q.index_copy_(0, _long(unseeded, probs.device), draw)
        for i in seeded:
            request = requests[i]
            assert request.params.seed is not None
            self._seeded.manual_seed(seed_for_position(request.params.seed, len(request.output_token_ids)))
            q[i].uniform_(generator=self._seeded)  # [0, 1), the same stream as torch.rand
        return q.log_().neg_()

    # ---- to the host ------------------------------------------------------------------------------------------

    def _collect(
        self,
        tokens: torch.Tensor,
        finite: torch.Tensor,
        valid: torch.Tensor,
        requests: Sequence[Request],
        lp_rows: list[int],
        lp: tuple[torch.Tensor, ...] | None,
        prompt_scores: Sequence[PromptScores],
    ) -> SampleResult:
        """One host transfer: ids and validity alone when that is all, else every figure in one float64 vector (exact
        for ids and float32). A failed row's token is -1 (raw logits not finite) or -2 (processed ones unusable)."""
        num_rows = len(requests)
        codes = tokens.masked_fill(~valid, -2).masked_fill_(~finite, -1)
        if lp is None and not prompt_scores:
            ids = codes.tolist()
            tokens_list: list[int | None] = [t if t >= 0 else None for t in ids]
            return SampleResult(tokens_list, _errors(ids, requests), [None] * num_rows, {})
        parts = [codes.double()]
        if lp is not None:
            parts += [t.double().reshape(-1) for t in lp]
        for scores in prompt_scores:
            parts += [
                scores.chosen.double(),
                scores.top_values.double().reshape(-1),
                scores.top_ids.double().reshape(-1),
            ]
        flat = torch.cat(parts).tolist()
        ids = [int(t) for t in flat[:num_rows]]
        tokens_list = [t if t >= 0 else None for t in ids]
        pos = num_rows
        logprobs: list[TokenLogprob | None] = [None] * num_rows
        if lp is not None:
            n, k = len(lp_rows), lp[1].shape[-1]
            chosen, pos = flat[pos : pos + n], pos + n
            values, pos = flat[pos : pos + n * k], pos + n * k
            top_ids, pos = flat[pos : pos + n * k], pos + n * k
            for j, row in enumerate(lp_rows):
                token = tokens_list[row]
                if token is None:
                    continue
                want = requests[row].params.logprobs or 0
                top = [(int(top_ids[j * k + c]), values[j * k + c]) for c in range(want)]
                logprobs[row] = TokenLogprob(token, chosen[j], top)
        prompt: dict[str, list[TokenLogprob]] = {}
        for scores in prompt_scores:
            n, k = scores.top_values.shape
            chosen, pos = flat[pos : pos + n], pos + n
            values, pos = flat[pos : pos + n * k], pos + n * k
            top_ids, pos = flat[pos : pos + n * k], pos + n * k
            prompt_ids = scores.request.prompt_token_ids
            entries = prompt.setdefault(scores.request.request_id, [])
            for j in range(n):
                top = [(int(top_ids[j * k + c]), values[j * k + c]) for c in range(k)]
                entries.append(TokenLogprob(prompt_ids[scores.first_entry + j], chosen[j], top))
        return SampleResult(tokens_list, _errors(ids, requests), logprobs, prompt)


def _errors(codes: list[int], requests: Sequence[Request]) -> list[str | None]:
    errors: list[str | None] = []
    for code, req in zip(codes, requests):
        if code >= 0:
            errors.append(None)
        elif code == -1:
            errors.append("sampling failed: the logits are not finite")
        else:
            errors.append(
                "sampling failed: the probabilities are not finite or leave nothing to sample "
                f"(temperature={req.params.temperature!r})"
            )
    return errors


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return long_tensor(values, device)


def _apply_penalties(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """OpenAI presence / frequency penalties on the output's counts and the CTRL repetition penalty on prompt and
    output tokens (transformers' and vLLM's rule), for ``rows`` of ``logits``, in place."""
    device, vocab = logits.device, logits.shape[-1]
    index = _long(rows, device)
    sub = logits[index]
    params: list[SamplingParams] = [r.params for r in requests]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_rows = [i for i, r in enumerate(requests) for _ in range(r.num_tokens)]
        seen_ids = [t for r in requests for t in (r.prompt_token_ids + r.output_token_ids)]
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=device)  # column vocab: out-of-range ids
        seen[_long(seen_rows, device), _long(seen_ids, device).clamp_(max=vocab)] = True
        penalty = to_device([p.repetition_penalty for p in params], sub.dtype, device).unsqueeze(1)
        sub = torch.where(seen[:, :vocab], torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        out_rows = [i for i, r in enumerate(requests) for _ in r.output_token_ids]
        out_ids = [t for r in requests for t in r.output_token_ids]
        counts = torch.zeros(len(rows), vocab + 1, dtype=sub.dtype, device=device)
        if out_ids:
            ones = torch.ones(len(out_ids), dtype=sub.dtype, device=device)
            counts.index_put_(
                (_long(out_rows, device), _long(out_ids, device).clamp_(max=vocab)), ones, accumulate=True
            )
        counts = counts[:, :vocab]
        presence = to_device([p.presence_penalty for p in params], sub.dtype, device).unsqueeze(1)
        frequency = to_device([p.frequency_penalty for p in params], sub.dtype, device).unsqueeze(1)
        sub = sub - presence * (counts > 0) - frequency * counts
    logits[index] = sub


def _top_k_top_p(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """top-k (0: off; ties at the k-th kept), then top-p over the rest: a token goes when the tokens above it already
    cover top_p (the most likely always stays). In place. Each row keeps the scores above one threshold, found over
    the largest ``max(top_k)`` (``topk``) when every top-p row has a top-k, else over a sort of the whole vocabulary
    (about 100 ms for [32, 49152] on one CPU core, against 2 ms for ``topk`` of 50)."""
    device, vocab = scores.device, scores.shape[-1]
    used = [i for i, (k, p) in enumerate(zip(top_k, top_p)) if k or p < 1.0]
    sub = scores if len(used) == len(top_k) else scores[_long(used, device)]
    ks = [top_k[i] or vocab for i in used]
    width = max(ks)
    ordered = torch.sort(sub, dim=-1, descending=True).values if width == vocab else torch.topk(sub, width).values
    beyond_k = torch.arange(width, device=device).unsqueeze(0) >= _long(ks, device).clamp(max=width).unsqueeze(1)
    ordered.masked_fill_(beyond_k, _NEG_INF)
    probs = torch.softmax(ordered, dim=-1)
    # top_p 1 keeps everything: an infinite bound, so float rounding of the sum never drops a tail token
    bound = [top_p[i] if top_p[i] < 1.0 else float("inf") for i in used]
    p = to_device(bound, probs.dtype, device).unsqueeze(1)
    dropped = beyond_k | ((probs.cumsum(dim=-1) - probs) >= p)
    threshold = ordered.masked_fill(dropped, float("inf")).amin(dim=-1, keepdim=True)
    sub.masked_fill_(sub < threshold, _NEG_INF)
    if sub is not scores:
        scores[_long(used, device)] = sub


_DEFAULT = Sampler()


def sample(
    logits: torch.Tensor, requests: Sequence[Request], prompt_scores: Sequence[PromptScores] = ()
) -> SampleResult:
    """Sample with a default sampler (no EOS ids for min_tokens): for tests and callers without an engine."""
    return _DEFAULT.sample(logits, requests, prompt_scores)
