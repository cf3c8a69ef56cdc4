"""The engine one worker runs: a model, its paged KV cache, a continuous-batching scheduler and a sampler.

Three ways in:
- ``add_request`` + ``step``: a normal request, prefilled and decoded here (colocated serving, tests, ``generate``).
- ``add_request(prefill_only=True)``: prefill, sample the first token, then hold the blocks (status PREFILLED) until
  the KV has been exported with ``read_kv_blocks`` and the caller ``release``\\ s it: the prefill worker's path.
- ``reserve_remote`` + ``write_kv_blocks`` + ``complete_remote``: blocks reserved up front, KV written by the transfer
  layer, then the request joins the running batch with its first token: the decode worker's path.
  (``add_resumed_request``: the same request when its KV never came, prefilled here with that first token.)

Every output carries ``text_delta``, the text its tokens add, made here by the request's incremental detokenizer in
time proportional to the new tokens, so workers stream text and the router only relays it. The first token's text is
sent by the prefill worker; the decode side runs the same deterministic detokenizer over the same tokens, so it
drops its own delta for that token and its later deltas continue exactly where the prefill worker's ended.

Every request leaves through ``_finish``, which frees its blocks exactly once; ``abort`` works in every state.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable

import torch

from engine.attention import LayerHook, register_paged_attention
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCache, KVSpec
from engine.model_loader import load_model
from engine.model_runner import ModelRunner, StepStats
from engine.request import (
    CompletionResult,
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    SamplingParams,
)
from engine.sampler import SampleResult, make_generator, sample
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        self.model, self.tokenizer = load_model(config.model, config.dtype, config.device, register_paged_attention())
        hf_config = self.model.config
        self.max_model_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
        self.kv_spec = KVSpec(
            architecture=hf_config.model_type,
            dtype=self.model.dtype,
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
            block_size=config.block_size,
        )
        num_blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // self.kv_spec.bytes_per_block)
        self.kv_cache = KVCache(self.kv_spec, num_blocks, config.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_tokens, config.max_num_seqs)
        self.runner = ModelRunner(self.model, self.kv_cache)
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self.requests: dict[str, Request] = {}  # every request not yet FINISHED
        self.step_stats: deque[StepStats] = deque(maxlen=1024)

    # ---- requests in -------------------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer(prompt, add_special_tokens=True).input_ids
        token_ids = list(prompt)
        vocab = self.model.config.vocab_size
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return token_ids

    def _new_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str | None,
        prefill_only: bool,
        arrival_s: float | None = None,
    ) -> Request:
        params = params or SamplingParams()
        params.validate()
        token_ids = self.tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} (room for one more is needed)"
            )
        if self.block_manager.blocks_for(len(token_ids) + 1) > self.block_manager.num_blocks:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than the whole KV cache holds")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, arrival_s or time.monotonic(), prefill_only=prefill_only)
        if not params.greedy:
            request.generator = make_generator(params.seed, self.config.device)
        return request

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        arrival_s: float | None = None,
    ) -> str:
        """Queue a request; ``arrival_s`` (time.monotonic) backdates it to when it reached the worker."""
        request = self._new_request(prompt, params, request_id, prefill_only, arrival_s)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def reserve_remote(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        headroom_tokens: int = 0,
    ) -> list[int] | None:
        """Reserve blocks for a prompt whose KV will arrive from elsewhere; None if the blocks are not free now.

        The reservation covers the prompt, the first generated token and ``headroom_tokens`` more (capped at what
        the request can generate), so the request can start decoding the moment its KV is complete and grow that
        far without asking for blocks.
        """
        request = self._new_request(prompt, params, request_id, prefill_only=False)
        headroom = min(headroom_tokens, request.params.max_tokens - 1, self.max_model_len - request.num_prompt_tokens - 1)
        allocation = self.block_manager.allocate(
            request.prompt_token_ids, request.num_prompt_tokens + 1 + max(0, headroom), use_prefix_cache=False
        )
        if allocation is None:
            return None
        request.block_ids = allocation[0]
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return list(request.block_ids)

    def complete_remote(self, request_id: str, first_token_id: int) -> list[RequestOutput]:
        """The imported KV is complete: the request joins the running batch with the token prefill sampled."""
        request = self._get(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        request.num_computed_tokens = request.num_prompt_tokens
        self._register_full_blocks(request)
        output = self._append_token(request, first_token_id, text_sent=True)
        if not request.is_finished:
            self.scheduler.add_running(request)
        return [output]

    def add_resumed_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str, first_token_id: int
    ) -> list[RequestOutput]:
        """A request whose first token was sampled (and its text sent) elsewhere, but whose KV must be computed here:
        the decode worker's recompute after a failed transfer. The prompt and that token are prefilled together and
        decoding goes on; the token counts towards ``max_tokens`` and finishes the request if it would have there."""
        request = self._new_request(prompt, params, request_id, prefill_only=False)
        self.requests[request.request_id] = request
        output = self._append_token(request, first_token_id, text_sent=True)
        if not request.is_finished:
            self.scheduler.add(request)
        return [output]

    # ---- the step ----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward over everything scheduled; returns the requests that gained a token or finished.

        A fault stays with the requests it concerns, and step() does not raise for it: a row that cannot be sampled
        (non-finite logits) fails its own request; a forward that raises (the model, or the layer hook) fails every
        request of this step, since their KV is incomplete. Both leave through ``_finish`` with FinishReason.ERROR
        and come back as finished outputs that carry the error; nothing of them stays queued to fail the next step.
        """
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        sampling = [c for c in chunks if c.samples]
        try:
            logits, stats = self.runner.execute(chunks)
            result = sample(logits, [c.request for c in sampling]) if sampling else SampleResult([], [])
        except Exception as exc:  # noqa: BLE001 - whatever the forward raised, these requests cannot go on
            logger.exception("forward step failed; failing its %d requests", len(chunks))
            message = f"forward step failed: {type(exc).__name__}: {exc}"
            return [self._fail(c.request, message, "worker_error") for c in chunks]
        self.step_stats.append(stats)
        failed = {c.request.request_id for c, error in zip(sampling, result.errors) if error is not None}
        for chunk in chunks:
            if chunk.request.request_id not in failed:  # a failed row's KV may be what went wrong: never cache it
                chunk.request.num_computed_tokens = chunk.end
                self._register_full_blocks(chunk.request)
        return [
            self._append_token(c.request, token) if error is None else self._fail(c.request, error, "sampling_error")
            for c, token, error in zip(sampling, result.token_ids, result.errors)
        ]

    def _fail(self, request: Request, error: str, code: str) -> RequestOutput:
        """End a request with FinishReason.ERROR (blocks freed by ``_finish``); the output says why."""
        logger.warning("request %s failed: %s", request.request_id, error)
        request.error = error
        self._finish(request, FinishReason.ERROR)
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
        )

    def _register_full_blocks(self, request: Request) -> None:
        """Blocks that just filled up join the prefix cache (generated text too, so multi-turn chats reuse it)."""
        if request.num_computed_tokens // self.config.block_size > request.num_hashed_blocks:
            request.num_hashed_blocks = self.block_manager.register_full_blocks(
                request.block_ids,
                request.token_slice(0, request.num_computed_tokens),
                request.num_computed_tokens,
                request.num_hashed_blocks,
            )

    def _append_token(self, request: Request, token_id: int, text_sent: bool = False) -> RequestOutput:
        """Add a sampled token, detokenize it (O(new tokens)) and finish the request if it is done.

        ``text_sent``: the token's text was already sent by a prefill worker, which ran exactly this non-final
        ``add`` on a fresh detokenizer; only what a finish adds beyond it is new.
        """
        request.output_token_ids.append(token_id)
        if request.first_token_s is None:
            request.first_token_s = time.monotonic()
        params = request.params
        stop_ids = request.stop_token_set
        if stop_ids is None:  # a set, made once: the check runs for every token
            stop_ids = request.stop_token_set = frozenset(params.stop_token_ids)
        reason: FinishReason | None = None
        if request.prefill_only:
            reason = FinishReason.PREFILLED
        elif (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in stop_ids:
            reason = FinishReason.STOP
        elif len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        detokenizer = request.detokenizer
        if detokenizer is None:
            detokenizer = request.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop)
        # a prefill-only request's first token is not flushed: its delta is what decoding continues from
        final = reason is not None and not request.prefill_only
        if text_sent:
            detokenizer.add((token_id,), final=False)
            delta = detokenizer.add((), final=True) if final and not detokenizer.finished else ""
        else:
            delta = detokenizer.add((token_id,), final=final)
        if detokenizer.stopped and not request.prefill_only:
            reason = FinishReason.STOP  # a stop string, cut from the text (over LENGTH when both, as checked first)
        if reason is not None:
            self._finish(request, reason)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[token_id],
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=len(request.output_token_ids),
            text=request.output_text,
            text_delta=delta,
        )

    def _detokenize(self, request: Request, final: bool) -> IncrementalDetokenizer:
        """Give the request's incremental detokenizer (made on first use) the tokens it has not seen yet."""
        detokenizer = request.detokenizer
        if detokenizer is None:
            detokenizer = request.detokenizer = IncrementalDetokenizer(self.tokenizer, request.params.stop)
        detokenizer.add(request.output_token_ids[detokenizer.num_tokens :], final=final)
        return detokenizer

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.remove(request)
        request.output_text = self._detokenize(request, final=True).text  # the whole text, cut at a stop string
        request.finish_reason = reason
        request.finished_s = time.monotonic()
        if reason == FinishReason.PREFILLED:
            request.status = RequestStatus.PREFILLED  # blocks held until release()
            return
        self.block_manager.free(request.block_ids)
        request.status = RequestStatus.FINISHED
        self.requests.pop(request.request_id, None)

    # ---- requests out ------------------------------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        """Free a request's blocks now, whatever its state; False if it is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.PREFILLED:
            self.release(request_id)
        else:
            self._finish(request, FinishReason.ABORT)
        return True

    def release(self, request_id: str) -> None:
        """Free a PREFILLED request's blocks once its KV has been exported (or its lease ended)."""
        request = self._get(request_id, RequestStatus.PREFILLED)
        self.block_manager.free(request.block_ids)
        request.status = RequestStatus.FINISHED
        self.requests.pop(request_id, None)

    def _get(self, request_id: str, status: RequestStatus) -> Request:
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown request {request_id!r}")
        if request.status != status:
            raise ValueError(f"request {request_id!r} is {request.status.name}, expected {status.name}")
        return request

    # ---- KV export and import (the transfer layer's side) ------------------------------------------------------

    def request_block_ids(self, request_id: str) -> list[int]:
        return list(self.requests[request_id].block_ids)

    def read_kv_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache.read_blocks(layer, block_ids)

    def write_kv_blocks(self, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv_cache.write_blocks(layer, block_ids, k, v)

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """Called after each layer's KV is written in every forward: the prefill worker streams KV from here."""
        self.runner.layer_hook = hook

    # ---- convenience and introspection -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """One small prefill and decode, so the first real request does not pay for lazy initialisation."""
        [result] = self.generate(
            [[0] * min(32, self.max_model_len - 2)], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        )
        if result.error is not None:  # a model that cannot run one forward must not start serving
            raise RuntimeError(f"warm-up failed: {result.error}")
        self.block_manager.reset_prefix_cache()
        self.step_stats.clear()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionResult]:
        prompts = list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params must be one SamplingParams or one per prompt")
        ids = [self.add_request(p, _copy(sp)) for p, sp in zip(prompts, params_list)]
        requests = {rid: self.requests[rid] for rid in ids}
        while any(not r.is_finished for r in requests.values()):
            self.step()
        return [
            CompletionResult(
                text=r.output_text,
                token_ids=list(r.output_token_ids),
                finish_reason=r.finish_reason.value,
                num_prompt_tokens=r.num_prompt_tokens,
                num_cached_tokens=r.num_cached_tokens,
                error=r.error,
            )
            for r in requests.values()
        ]

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def check_no_leaks(self) -> None:
        """Raise unless every block is free and no request is left: the check every test ends with."""
        if self.requests or self.scheduler.has_work():
            raise AssertionError(f"requests left: {sorted(self.requests)[:10]}")
        self.block_manager.check_all_free()


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def _eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
