"""The output path of a step: what a sampled token makes of a request (finish reason, text, ``RequestOutput``).

Called by ``LLMEngine`` once per sampled token and per finish; it never touches the scheduler or the KV cache, nor
keeps the tokenizer. Every output's ``text_delta`` comes from the request's incremental detokenizer, so workers
stream text and the router only relays it. The prefill worker sends the first token's text; the decode side runs the
same deterministic detokenizer over the same tokens and drops its own delta for that token, continuing exactly there.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.request import CompletionResult, FinishReason, Request, RequestOutput, TokenLogprob


def add_token(
    request: Request,
    token_id: int,
    tokenizer: Any,
    eos_token_ids: Set[int],
    length_limit: int,  # tokens in all: max_model_len, or less when the KV cache holds fewer
    text_sent: bool = False,
) -> tuple[FinishReason | None, str]:
    """Add a sampled token (its grammar already accepted it) and detokenize it; returns why the request is done
    (None: it goes on) and the token's text, for the caller to finish the request. ``text_sent``: a prefill worker
    sent the text, having run exactly this non-final ``add`` on a fresh detokenizer; only a finish's rest is new."""
    request.output_token_ids.append(token_id)
    params = request.params
    stop_ids = request.stop_token_set
    if stop_ids is None:  # a set, made once: the check runs for every token
        stop_ids = request.stop_token_set = frozenset(params.stop_token_ids)
    grammar = request.grammar
    reason: FinishReason | None = None
    if request.prefill_only:
        reason = FinishReason.PREFILLED
    elif (token_id in eos_token_ids and not params.ignore_eos) or token_id in stop_ids:
        reason = FinishReason.STOP
    elif grammar is not None and grammar.is_terminated():  # the grammar is complete and took its EOS
        reason = FinishReason.STOP
    elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= length_limit:
        reason = FinishReason.LENGTH
    detokenizer = request.detokenizer
    if detokenizer is None:
        detokenizer = request.detokenizer = _make_detokenizer(request, tokenizer)
    # a prefill-only request's first token is not flushed: its delta is what decoding continues from
    final = reason is not None and not request.prefill_only
    if text_sent:
        detokenizer.add((token_id,), final=False)
        delta = detokenizer.add((), final=True) if final and not detokenizer.finished else ""
    else:
        delta = detokenizer.add((token_id,), final=final)
    if detokenizer.stopped and not request.prefill_only:
        reason = FinishReason.STOP  # a stop string, cut from the text (over LENGTH when both, as checked first)
    return reason, delta


def token_output(
    request: Request,
    token_id: int,
    reason: FinishReason | None,
    delta: str,
    logprob: TokenLogprob | None = None,
    text_sent: bool = False,
) -> RequestOutput:
    """The output of a request that gained ``token_id`` (made after finishing the request, if it finished)."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[token_id],
        finished=reason is not None,
        finish_reason=reason,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(request.output_token_ids),
        text=request.output_text,
        text_delta=delta,
        timing=request.timing,
        kv_import=request.kv_import,
        logprobs=None if logprob is None else [logprob],
        prompt_logprobs=_prompt_logprobs_out(request, text_sent),
        num_cached_tokens=request.num_cached_tokens,
    )


def error_output(request: Request, error: str, code: str) -> RequestOutput:
    """The finished output of a request that failed (made after finishing it with FinishReason.ERROR)."""
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[],
        finished=True,
        finish_reason=FinishReason.ERROR,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=len(request.output_token_ids),
        text=request.output_text,
        error=error,
        error_code=code,
        timing=request.timing,
        kv_import=request.kv_import,
        num_cached_tokens=request.num_cached_tokens,
    )


def detokenize(request: Request, tokenizer: Any, final: bool) -> IncrementalDetokenizer:
    """Give the request's incremental detokenizer (made on first use) the tokens it has not seen yet."""
    detokenizer = request.detokenizer
    if detokenizer is None:
        detokenizer = request.detokenizer = _make_detokenizer(request, tokenizer)
    detokenizer.add(request.output_token_ids[detokenizer.num_tokens :], final=final)
    return detokenizer


def _make_detokenizer(request: Request, tokenizer: Any) -> IncrementalDetokenizer:
    params = request.params
    return IncrementalDetokenizer(tokenizer, params.stop, skip_special_tokens=params.skip_special_tokens)


def _prompt_logprobs_out(request: Request, text_sent: bool) -> list[TokenLogprob | None] | None:
    """The prompt logprobs go with the first token sampled here (for a decode-side admission the prefill worker
    sent them); a one-token prompt has only entry 0."""
    if request.params.prompt_logprobs is None or text_sent or len(request.output_token_ids) != 1:
        return None
    return request.prompt_logprobs or [None]


def merge_outputs(admitted: dict[str, RequestOutput], outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request and step: an admission's text (non-empty only when it finished, and then the request
    computed nothing this step) goes before what the request's forward added."""
    for output in outputs:
        first = admitted.pop(output.request_id, None)
        if first is not None:
            output.text_delta = first.text_delta + output.text_delta
    return [*admitted.values(), *outputs]


def extend_output(output: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for a request that gained several tokens in a step (speculative decoding): ``later`` continues
    ``output``; an error ends it."""
    if later.error is not None or output.error is not None:
        return later if output.error is None else output
    output.new_token_ids = output.new_token_ids + later.new_token_ids
    output.text_delta += later.text_delta
    if later.logprobs is not None:
        output.logprobs = (output.logprobs or []) + later.logprobs
    output.finished, output.finish_reason = later.finished, later.finish_reason
    output.num_output_tokens, output.text = later.num_output_tokens, later.text
    return output


def completion(request: Request) -> CompletionResult:
    if request.finish_reason is None:
        raise RuntimeError(f"request {request.request_id!r} has not finished")
    return CompletionResult(
        text=request.output_text,
        token_ids=list(request.output_token_ids),
        finish_reason=request.finish_reason.value,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        error=request.error,
    )
