"""The engine one worker runs: a model, its paged KV cache, a continuous-batching scheduler and a sampler.

Three ways in:
- ``add_request`` + ``step``: a normal request, prefilled and decoded here (colocated serving, tests, ``generate``).
- ``add_request(prefill_only=True, kv_sink=...)``: prefill, sample the first token, then hold the blocks (status
  PREFILLED) until the caller ``release``\\ s them; the KV connector (``engine.kv_connector``) reports the request's
  completed blocks to ``kv_sink``, layer by layer inside the forward (``stream_kv``) or all at the end: the prefill
  worker's path.
- ``reserve_remote`` (status WAITING_FOR_REMOTE_KV), KV written by the transfer layer (``write_remote_kv``), then
  ``remote_first_token`` and ``remote_kv_done`` in either order: the scheduler admits the request at the next
  ``step``, whose output for it continues the text from the first token. ``remote_kv_failed`` ends it, or has it
  prefilled here with that first token (recompute); ``expire_remote`` frees reservations whose first token never
  came: the decode worker's path. With ``prefix_cache=True`` the reservation reuses the full prompt blocks this
  engine already holds (a chat's history it just decoded: generated tokens are cached too) and only the missing
  blocks are new and written (``Request.num_cached_tokens`` says where they start). ``prefill_here`` turns a
  reservation into a request computed here (its missing tokens, then its first token sampled here): conditional
  disaggregation, for prompts whose uncached part is short.

``set_layer_hook`` is for fault injection only (tests slow or fail a forward with it): the KV hand-off never needs it.

The first two live in ``engine.engine_core``; this file adds the third, the decode side of the hand-off.
"""

from __future__ import annotations

import time

import torch

from engine.attention import LayerHook
from engine.blocks import blocks_for_tokens, reserved_tokens
from engine.engine_core import EngineCore
from engine.request import (
    FinishReason,
    RemoteKV,
    Request,
    RequestStatus,
    SamplingParams,
)


class LLMEngine(EngineCore):
    """The engine with the decode side of the KV hand-off: reservations, the first token, KV done or failed."""

    def reserve_remote(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        headroom_tokens: int = 0,
        prefix_cache: bool = False,
    ) -> list[int] | None:
        """Reserve blocks for a prompt whose KV will arrive from elsewhere; None if the blocks are not free now, or
        this engine already holds ``max_num_seqs`` requests (``at_seq_limit``).

        The reservation covers the prompt, the first generated token and ``headroom_tokens`` more (capped at what
        the request can generate), so the request can start decoding the moment its KV is complete and grow that
        far without asking for blocks: ``engine.blocks.reserved_blocks`` blocks, the count the router plans with.
        The prompt's KV goes into the first ``blocks_for_tokens(len(prompt), block_size)`` of the returned ids.
        The request waits (WAITING_FOR_REMOTE_KV) for ``remote_first_token`` and ``remote_kv_done``.

        ``prefix_cache``: the leading full prompt blocks this engine's prefix cache holds are shared, not reserved
        anew (never the whole prompt: one token is always left to compute, for the first token's logits); their
        count in tokens is ``requests[id].num_cached_tokens`` (a multiple of the block size), and only the blocks
        from there on are expected (``write_remote_kv``). Off by default: a caller that sends every block (the
        engine tests' own hand-offs) must not have some of them refused.
        """
        request = self._new_request(prompt, params, request_id, prefill_only=False)
        if self.at_seq_limit():
            return None
        num_tokens = reserved_tokens(
            request.num_prompt_tokens, request.params.max_tokens, headroom_tokens, self.max_model_len
        )
        # a request that wants prompt logprobs shares nothing: prefill_here must compute its whole prompt (the
        # prefill worker computes it anyway, and exports every block)
        use_cache = prefix_cache and request.params.prompt_logprobs is None
        if not self.scheduler.reserve_remote(request, num_tokens, use_cache):
            return None
        self.requests[request.request_id] = request
        return list(request.block_ids)

    def at_seq_limit(self) -> bool:
        """True when this engine holds ``max_num_seqs`` requests: a further reservation is refused, so a decode
        step never has more rows than the configured batch (the decode gather buffer and the KV plan are bounded by
        it; vLLM caps its running batch the same way). The router tries another decode worker or queues."""
        return len(self.requests) >= self.config.max_num_seqs

    def missing_prompt_blocks(self, request: Request) -> list[int]:
        """The physical blocks a reservation's imported KV goes into: its prompt's, after those it shares from the
        prefix cache (what the receiver expects and the prefill worker sends)."""
        block_size = self.config.block_size
        first = request.num_cached_tokens // block_size
        return request.block_ids[first : blocks_for_tokens(request.num_prompt_tokens, block_size)]

    def prefill_here(self, request_id: str) -> None:
        """Compute a reservation's prompt here instead of importing it (conditional disaggregation: the router sends
        short uncached parts no prefill worker). It becomes an ordinary running request on its reserved blocks:
        the next steps compute the tokens after its cached prefix, sample its first token here (its output carries
        it, with its text) and decode on. ``Request.remote`` is dropped: nothing comes from elsewhere any more.

        Raises KeyError for an unknown request and ValueError unless it is an untouched reservation (waiting, no
        first token, its transfer not ended).
        """
        request = self._get(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        remote = _remote(request)
        if remote.first_token_id is not None or remote.kv_done_s is not None or remote.kv_failed:
            raise ValueError(f"request {request_id!r} is already taking its KV from a prefill worker")
        self.scheduler.prefill_here(request)

    def remote_first_token(self, request_id: str, token_id: int) -> None:
        """The first token, sampled (and its text sent) by the prefill worker, reached this worker.

        Raises KeyError for an unknown request (never reserved here, or already ended) and ValueError when it is not
        waiting for remote KV, already has its first token, or the id is not in the vocabulary.
        """
        request = self._get(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        remote = _remote(request)
        if remote.first_token_id is not None:
            raise ValueError(f"request {request_id!r} already has its first token")
        if not isinstance(token_id, int) or not 0 <= token_id < self.model.config.vocab_size:
            raise ValueError(f"first token id must be an integer in [0, {self.model.config.vocab_size})")
        remote.first_token_id = token_id
        remote.first_token_arrived_s = time.monotonic()
        self.scheduler.remote_progress(request)

    def write_remote_kv(
        self, request_id: str, layer: int, block_ids: list[int], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write one layer of a request's imported KV into its reserved blocks: the KV receiver's sink (same
        signature, the transfer id being the request id).

        Raises (so the receiver fails that transfer, and nothing is written) unless the request is waiting for its KV
        and ``block_ids`` are among the blocks reserved for its prompt and missing here: a late or stray piece never
        lands in blocks that another request holds now, nor in the prefix-cached blocks this request shares.
        """
        request = self._get(request_id, RequestStatus.WAITING_FOR_REMOTE_KV)
        remote = _remote(request)
        if remote.kv_done_s is not None or remote.kv_failed:
            raise ValueError(f"the KV transfer of request {request_id!r} has already ended")
        if not set(block_ids) <= set(self.missing_prompt_blocks(request)):
            raise ValueError(f"blocks {block_ids} are not reserved for the prompt of request {request_id!r}")
        self.kv_cache.write_blocks(layer, block_ids, k, v)

    def remote_kv_done(self, request_id: str) -> bool:
        """Every layer of the request's KV is in its reserved blocks. False if the request is gone (aborted or
        expired meanwhile: its blocks are already free); ValueError if its transfer had already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        remote = _remote(self._get(request_id, RequestStatus.WAITING_FOR_REMOTE_KV))
        if remote.kv_done_s is not None or remote.kv_failed:
            raise ValueError(f"the KV transfer of request {request_id!r} has already ended")
        remote.kv_done_s = time.monotonic()
        self.scheduler.remote_progress(request)
        return True

    def remote_kv_failed(self, request_id: str, recompute: bool) -> bool:
        """The request's KV transfer failed; its reserved blocks (partly written) are freed now.

        ``recompute=False``: the request ends with FinishReason.ABORT and no output: it did nothing wrong, and the
        caller (which knows whether the peer gave up on purpose and has told the client) reports the cause.
        ``recompute=True``: it stays, blockless, until its first token is in; then it is prefilled here with that
        token, as any waiting request (``num_recomputes`` counts it), and decodes on.
        False if the request is gone (aborted or expired meanwhile); ValueError if its transfer had already ended.
        """
        request = self.requests.get(request_id)
        if request is None:
            return False
        remote = _remote(self._get(request_id, RequestStatus.WAITING_FOR_REMOTE_KV))
        if remote.kv_done_s is not None or remote.kv_failed:
            raise ValueError(f"the KV transfer of request {request_id!r} has already ended")
        remote.kv_failed_s = time.monotonic()
        if not recompute:
            self._finish(request, FinishReason.ABORT)
            return True
        self.block_manager.free(request.block_ids)  # the prefill here allocates afresh (prefix cache included)
        remote.recompute = True
        self.scheduler.remote_progress(request)
        return True

    def expire_remote(self, max_wait_s: float) -> list[str]:
        """Free the reservations whose first token has not come ``max_wait_s`` after they were made (the router lost
        them or died); they end with FinishReason.ABORT and no output. Returns their ids, for the caller to report."""
        now = time.monotonic()
        expired = [
            request
            for request in self.requests.values()
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV
            and (remote := request.remote) is not None
            and remote.first_token_id is None
            and now - remote.expected_s > max_wait_s
        ]
        for request in expired:
            self._finish(request, FinishReason.ABORT)
        return [request.request_id for request in expired]

    # ---- fault injection ----------------------------------------------------------------------------------------

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """For fault injection only: ``hook(layer, batch)`` runs after each layer's KV is written in every forward,
        after the KV connector's own exports for that layer. What it raises fails that step's requests, as a failing
        forward does; what it sleeps delays the rest of the forward (tests/cluster slow or fail prefills with it).
        ``None`` removes it."""
        self.kv_exporter.user_hook = hook


def _remote(request: Request) -> RemoteKV:
    remote = request.remote
    if remote is None:
        raise ValueError(f"request {request.request_id!r} has no remote KV")
    return remote
