"""The core of the engine: requests in, one forward per ``step``, outputs out, and every request's one way out.

``LLMEngine`` (``engine.llm_engine``) is what a worker runs: this core plus the decode side's remote-KV API. Split so
that each file holds one idea: here the step loop (admission, forward, sampling, finish); there how a request
whose KV comes from elsewhere enters and leaves. The parts it steps (model, KV cache, runner, sampler) are built on
the device by ``engine.engine_parts``; what a sampled token makes of its request (finish reason, ``text_delta``,
the ``RequestOutput``) is ``engine.outputs``.

Every request leaves through ``_finish``, which frees its blocks exactly once; ``abort`` works in every state.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Iterable

from engine.block_manager import BlockManager
from engine.blocks import blocks_for_tokens
from engine.config import EngineConfig
from engine.engine_parts import build_engine_parts
from engine.kv_connector import KVExporter, KVSink
from engine.model_runner import StepStats
from engine.outputs import add_token, completion, detokenize, error_output, merge_outputs, token_output
from engine.request import (
    CompletionResult,
    FinishReason,
    KVExport,
    Request,
    RequestOutput,
    RequestStatus,
    RequestTiming,
    SamplingParams,
    TokenLogprob,
)
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        parts = build_engine_parts(config)  # the model and what runs it, on the device (engine.engine_parts)
        self.config, self.model, self.tokenizer = parts.config, parts.model, parts.tokenizer
        self.max_model_len, self.kv_spec, self.memory_plan = parts.max_model_len, parts.kv_spec, parts.memory_plan
        self.kv_cache, self.runner, self.sampler = parts.kv_cache, parts.runner, parts.sampler
        self.eos_token_ids, self.vocab_size = parts.eos_token_ids, parts.vocab_size
        config = self.config
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_tokens, config.max_num_seqs)
        self.kv_exporter = KVExporter(self.kv_cache)
        self.requests: dict[str, Request] = {}  # every request not yet FINISHED
        self.step_stats: deque[StepStats] = deque(maxlen=1024)
        self.num_recomputes = 0  # remote requests whose KV transfer failed and that were prefilled here instead

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
        if self.config.prefill_only and not prefill_only:
            raise ValueError("this engine only prefills (prefill_only): add requests with prefill_only=True")
        params = params or SamplingParams()
        params.validate(prefill_only=prefill_only)
        if any(token_id >= self.vocab_size for token_id in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids below the vocabulary size {self.vocab_size}")
        token_ids = self.tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len} (room for one more is needed)"
            )
        if blocks_for_tokens(len(token_ids) + 1, self.config.block_size) > self.block_manager.num_blocks:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than the whole KV cache holds")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        timing = RequestTiming(arrival_s or time.monotonic())
        request = Request(request_id, token_ids, params, timing, prefill_only=prefill_only)
        if params.guided is not None:  # a spec that does not compile is this request's ValueError (GrammarError)
            from engine.structured import GrammarState, compile_grammar  # xgrammar: only for guided requests

            compiled = compile_grammar(self.tokenizer, self.vocab_size, params.guided, sorted(self.eos_token_ids))
            request.grammar = GrammarState(compiled)
        return request

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prefill_only: bool = False,
        arrival_s: float | None = None,
        kv_sink: KVSink | None = None,
        stream_kv: bool = True,
        export_from_token: int = 0,
    ) -> str:
        """Queue a request; ``arrival_s`` (time.monotonic) backdates it to when it reached the worker.

        ``kv_sink`` (prefill-only requests): where its KV goes, as ``KVBlocksReady`` reports (``engine.kv_connector``):
        with ``stream_kv``, from inside each forward as blocks complete; without, every layer of the prompt once it is
        done, before ``step`` returns the first token. What the sink raises fails the request(s) of that step.
        ``export_from_token``: the receiver already holds the prompt's first tokens up to here (whole blocks, fewer
        than the prompt: the last token is always computed for the first token's logits); only the blocks from
        there on are reported. Those tokens are still computed here unless this engine's prefix cache has them.
        """
        if kv_sink is not None and not prefill_only:
            raise ValueError("kv_sink is for prefill-only requests (their KV is exported, then released)")
        if export_from_token and kv_sink is None:
            raise ValueError("export_from_token needs a kv_sink")
        request = self._new_request(prompt, params, request_id, prefill_only, arrival_s)
        if export_from_token % self.config.block_size or not 0 <= export_from_token < request.num_prompt_tokens:
            raise ValueError(
                f"export_from_token must be a multiple of the block size ({self.config.block_size}) below the "
                f"prompt's {request.num_prompt_tokens} tokens, got {export_from_token}"
            )
        if kv_sink is not None:
            request.kv_export = KVExport(kv_sink, stream_kv, first_block=export_from_token // self.config.block_size)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    # ---- the step ----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward over everything scheduled; returns the requests that gained a token or finished.

        A fault stays with the requests it concerns, and step() does not raise for it: a row that cannot be sampled
        (non-finite logits) fails its own request; a forward that raises (the model, or the layer hook) fails every
        request of this step, since their KV is incomplete; so does a streamed KV sink that raises (it runs inside the
        forward), while an unstreamed sink that raises fails only its own request. All leave through ``_finish`` with
        FinishReason.ERROR and come back as finished outputs that carry the error; nothing of them stays queued to
        fail the next step.

        Remote requests whose KV and first token are in are admitted first (between steps, continuous batching). An
        admission's output (``_admit_remote``) is merged into the request's output of this step when it has one, so
        a request has at most one output per step.
        """
        admitted = self._admit_remote() if self.scheduler.remote_ready else {}
        chunks = self.scheduler.schedule()
        if not chunks:
            return list(admitted.values())
        sampling = [c for c in chunks if c.samples]
        self.runner.layer_hook = self.kv_exporter.layer_hook_for(chunks)
        try:
            logits, stats = self.runner.execute(chunks)
            result = self.sampler.sample(logits, [c.request for c in sampling], self.runner.score_prompts(chunks))
        except Exception as exc:  # whatever the forward raised, these requests cannot go on
            self.kv_exporter.discard()
            logger.exception("forward step failed; failing its %d requests", len(chunks))
            message = f"forward step failed: {type(exc).__name__}: {exc}"
            return merge_outputs(admitted, [self._fail(c.request, message, "worker_error") for c in chunks])
        self.kv_exporter.commit()
        self.step_stats.append(stats)
        failed = {c.request.request_id for c, error in zip(sampling, result.errors) if error is not None}
        for chunk in chunks:
            if chunk.request.request_id not in failed:  # a failed row's KV may be what went wrong: never cache it
                chunk.request.num_computed_tokens = chunk.end
                self.scheduler.register_full_blocks(chunk.request)
                entries = result.prompt_logprobs.get(chunk.request.request_id)
                if entries:
                    chunk.request.prompt_logprobs = (chunk.request.prompt_logprobs or [None]) + entries
        rows = zip(sampling, result.token_ids, result.errors, result.logprobs)
        outputs = [self._sampled(chunk.request, token, error, logprob) for chunk, token, error, logprob in rows]
        return merge_outputs(admitted, outputs) if admitted else outputs

    def _sampled(
        self, request: Request, token_id: int | None, error: str | None, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """A row of this step's sample: the request gains its token, or fails with the row's error."""
        if token_id is None:
            return self._fail(request, error or "sampling failed", "sampling_error")
        export = request.kv_export
        if export is not None and not export.stream:  # a prefill-only request's one sample: its prompt is done
            try:
                self.kv_exporter.export_whole_prompt(request)
            except Exception as exc:  # the sink failed: this request's KV cannot reach its peer
                logger.exception("KV export of request %s failed", request.request_id)
                return self._fail(request, f"KV export failed: {type(exc).__name__}: {exc}", "worker_error")
        remote = request.timing.remote
        if remote is not None and remote.admitted_s is not None and remote.first_decode_s is None:
            remote.first_decode_s = time.monotonic()
        return self._append_token(request, token_id, logprob=logprob)

    def _admit_remote(self) -> dict[str, RequestOutput]:
        """The scheduler's remote admissions: each gains the first token the prefill worker sampled (its text already
        sent there: the output's ``new_token_ids`` is [] and its ``text_delta`` continues after that token's text);
        it may finish right there (max_tokens=1, EOS)."""
        outputs: dict[str, RequestOutput] = {}
        for request in self.scheduler.admit_remote():
            remote = request.remote
            assert remote is not None and remote.first_token_id is not None  # the scheduler admits only ready ones
            if remote.recompute:
                self.num_recomputes += 1
            else:
                self.scheduler.register_full_blocks(request)
            output = self._append_token(request, remote.first_token_id, text_sent=True)
            output.new_token_ids = []
            outputs[request.request_id] = output
        return outputs

    def _fail(self, request: Request, error: str, code: str) -> RequestOutput:
        """End a request with FinishReason.ERROR (blocks freed by ``_finish``); the output says why."""
        logger.warning("request %s failed: %s", request.request_id, error)
        request.error = error
        self._finish(request, FinishReason.ERROR)
        return error_output(request, error, code)

    def _append_token(
        self, request: Request, token_id: int, text_sent: bool = False, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Add a sampled token, detokenize it (O(new tokens)) and finish the request if it is done (``engine.outputs``).

        ``text_sent``: the token's text was already sent by a prefill worker, which ran exactly this non-final
        ``add`` on a fresh detokenizer; only what a finish adds beyond it is new. Its grammar state (fresh: a decode
        side's request has accepted nothing before its first token) accepts the token here all the same, so the
        constraint continues from the prefill worker's first token.
        """
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token_id):  # the bitmask allowed it, so this is a bug
            return self._fail(request, f"token {token_id} does not match the request's grammar", "sampling_error")
        reason, delta = add_token(request, token_id, self.tokenizer, self.eos_token_ids, self.max_model_len, text_sent)
        if reason is not None:
            self._finish(request, reason)
        return token_output(request, token_id, reason, delta, logprob, text_sent)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.remove(request)
        # the whole text, cut at a stop string
        request.output_text = detokenize(request, self.tokenizer, final=True).text
        request.finish_reason = reason
        request.timing.finished_s = time.monotonic()
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

    # ---- convenience and introspection -------------------------------------------------------------------------

    def warm_up(self) -> None:
        """One small prefill and decode (a prefill-only engine: the prefill), so the first real request does not pay
        for lazy initialisation."""
        prompt = [0] * min(32, self.max_model_len - 2)
        if self.config.prefill_only:
            rid = self.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
            error = None
            while self.has_unfinished():
                error = next((o.error for o in self.step() if o.error is not None), error)
            if rid in self.requests:  # prefilled: nobody takes its KV
                self.release(rid)
        else:
            [result] = self.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            error = result.error
        if error is not None:  # a model that cannot run one forward must not start serving
            raise RuntimeError(f"warm-up failed: {error}")
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
        ids = [self.add_request(p, sp.copy()) for p, sp in zip(prompts, params_list)]
        requests = {rid: self.requests[rid] for rid in ids}
        while any(not r.is_finished for r in requests.values()):
            self.step()
        return [completion(r) for r in requests.values()]

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def check_no_leaks(self) -> None:
        """Raise unless every block is free and no request is left: the check every test ends with."""
        if self.requests or self.scheduler.has_work():
            raise AssertionError(f"requests left: {sorted(self.requests)[:10]}")
        self.block_manager.check_all_free()
