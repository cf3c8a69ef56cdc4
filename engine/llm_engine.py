"""The engine one worker runs: a model, its paged KV cache, a continuous-batching scheduler and a sampler.

Requests in, one forward per ``step``, outputs out; every request leaves through ``finish_request``, which frees its
blocks exactly once, and ``abort`` works in every state. Three ways in: ``add_request`` (computed here);
``add_request(prefill_only=True, kv_sink=...)`` (prefill worker: each finished block's KV is reported, then the
blocks are held until ``release``); ``kv_importer.reserve`` (decode worker: the hand-off's receiving side,
``engine.kv_connector``, admitted here once its KV and tokens are in). A decoding request leaves by ``freeze`` with
``kv_exporter.export_held``. Parts come from ``engine.engine_parts``; what a sampled token makes of its request is
``engine.outputs``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable

import torch

from engine.attention import LayerHook
from engine.block_manager import BlockManager, KvEventBatch
from engine.blocks import blocks_for_tokens
from engine.config import EngineConfig, KVPlace
from engine.engine_parts import EngineParts, build_engine_parts, check_same_weights, rebuild_engine_parts
from engine.expert_parallel import expert_traffic
from engine.host_values import long_tensor
from engine.kv_connector import KVExporter, KVImporter, KVSink
from engine.kv_tiers import KVTiers
from engine.model_runner import StepStats
from engine.outputs import (
    add_token,
    completion,
    detokenize,
    error_output,
    extend_output,
    merge_outputs,
    token_output,
)
from engine.rank_tiers import build_tiers
from engine.request import (
    CompletionResult,
    FinishReason,
    ImportState,
    KVExport,
    Request,
    RequestOutput,
    RequestStatus,
    RequestTiming,
    SamplingParams,
    TokenLogprob,
)
from engine.scheduler import ScheduledChunk, Scheduler
from engine.speculative import build_speculator, measure_step_times
from engine.tensor_parallel import TPGroup

logger = logging.getLogger(__name__)
LOAD_WAIT_S = 0.005  # an engine with only KV-tier loads in flight waits this long for one per step


class LLMEngine:
    def __init__(self, config: EngineConfig, tp_group: TPGroup | None = None, parts: EngineParts | None = None) -> None:
        """``parts``: built elsewhere for ``config`` (the planner's simulated workers: a tiny KV cache and a runner
        whose forward computes nothing); by default ``build_engine_parts`` builds them here."""
        if parts is None:
            parts = build_engine_parts(config, tp_group)
        elif parts.config is not config:
            raise ValueError("parts were built for another config")
        self._parts = parts  # what ``reconfigured`` builds on
        self.config, self.model, self.tokenizer = parts.config, parts.model, parts.tokenizer
        self.max_model_len, self.kv_spec, self.memory_plan = parts.max_model_len, parts.kv_spec, parts.memory_plan
        self.attention = parts.attention  # what each layer's attention needs (engine.model_probe)
        self.kv_cache, self.runner, self.sampler = parts.kv_cache, parts.runner, parts.sampler
        self.eos_token_ids, self.vocab_size = parts.eos_token_ids, parts.vocab_size
        config = self.config
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_tokens, config.max_num_seqs)
        # the requests' timing stamps (they decide nothing); a simulation sets its own clock (``set_clock``)
        self.clock: Callable[[], float] = time.monotonic
        windows = [layer.sliding_window for layer in self.attention.layers]
        if all(windows):  # every layer forgets what is behind its window: those blocks can go back early
            self.scheduler.release_window = max(w for w in windows if w)
        # a request ends with "length" at max_model_len or when it alone would fill the whole KV cache: past that
        # it could only preempt itself, recompute and preempt itself again, forever
        self.length_limit = min(self.max_model_len, self.block_manager.num_blocks * config.block_size)
        split = self.runner.head_split
        # the whole model's KV layout, of which each rank of a tensor-parallel worker holds its heads (what a hand-off
        # between workers of any two degrees is planned on: engine.tensor_parallel.handoff_parts)
        self.handoff_spec = dataclasses.replace(self.kv_spec, num_kv_heads=split.kv_total) if split else self.kv_spec
        self.kv_exporter = KVExporter(self.kv_cache)
        self.kv_importer = KVImporter(self, self.scheduler, self.kv_cache)
        self.requests: dict[str, Request] = {}  # every request not yet FINISHED
        self.step_stats: deque[StepStats] = deque(maxlen=1024)
        self.num_recomputes = 0  # remote requests whose KV transfer failed and that were prefilled here instead
        self.tp_group = tp_group
        self.expert_traffic = expert_traffic(self.model)  # None unless its experts are split over the ranks
        self.speculator = build_speculator(config, self.vocab_size, self.max_model_len, LLMEngine)
        self.kv_tiers: KVTiers | None = build_tiers(config, self.kv_cache, self.model, split, self.runner.step_channel)
        if self.kv_tiers is not None:
            self.block_manager.record_evictions = True
            self.scheduler.tiers = self.kv_tiers

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

    def new_request(
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
        timing = RequestTiming(arrival_s or self.clock())
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

        ``kv_sink`` (prefill-only): where its KV goes (``engine.kv_connector``), streamed from inside each forward or
        all at once before ``step`` returns the first token; what it raises fails the request(s) of that step.
        ``export_from_token``: the receiver holds the prompt up to here (whole blocks), so only later blocks are
        reported (the tokens are still computed unless this prefix cache has them)."""
        if kv_sink is not None and not prefill_only:
            raise ValueError("kv_sink is for prefill-only requests (their KV is exported, then released)")
        if export_from_token and kv_sink is None:
            raise ValueError("export_from_token needs a kv_sink")
        request = self.new_request(prompt, params, request_id, prefill_only, arrival_s)
        if export_from_token % self.config.block_size or not 0 <= export_from_token < request.num_prompt_tokens:
            raise ValueError(
                f"export_from_token must be a multiple of the block size ({self.config.block_size}) below the "
                f"prompt's {request.num_prompt_tokens} tokens, got {export_from_token}"
            )
        if kv_sink is not None:  # tensor parallel: streamed, as the ranks gather its heads inside the forward
            stream_kv = stream_kv or self.config.ranks > 1
            request.kv_export = KVExport(kv_sink, stream_kv, first_block=export_from_token // self.config.block_size)
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        return request.request_id

    def drain_kv_events(self) -> list[tuple[KVPlace, KvEventBatch]]:
        """What the prefix cache and each KV tier below it gained and lost since the last drain, per tier (routers
        place by it: cluster/routing/prefix_index.py)."""
        batches: list[tuple[KVPlace, KvEventBatch]] = []
        if (batch := self.block_manager.drain_kv_events()) is not None:
            batches.append(("device", batch))
        if self.kv_tiers is not None:
            batches.extend(self.kv_tiers.drain_events())
        return batches

    def resync_kv_events(self) -> None:
        """The next drain is a snapshot of every tier (a reader missed a batch, or its periodic resync)."""
        self.block_manager.resync_kv_events()
        if self.kv_tiers is not None:
            self.kv_tiers.resync_events()

    def set_clock(self, clock: Callable[[], float]) -> None:
        """The clock of the requests' timing stamps (time.monotonic by default; a seeded simulation's own), which
        decide nothing but are reported."""
        self.clock = self.scheduler.clock = self.kv_importer.clock = clock

    # ---- the step ----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One forward over everything scheduled; returns the requests that gained a token or finished.

        Faults stay with their requests and step() does not raise: an unsamplable row or an unstreamed sink fails its
        own request; a forward that raises (model, layer hook, streamed sink) fails every request of the step (their
        KV is incomplete); all come back as finished outputs carrying the error. Ready remote requests are admitted
        first, their output merged into this step's, so a request has at most one output per step."""
        if self.kv_tiers is not None:
            self._finish_tier_loads()
        admitted = self._admit_remote() if self.scheduler.remote_ready else {}
        chunks = self.scheduler.schedule(self._proposals() if self.speculator is not None else None)
        self.save_evicted()
        if not chunks:
            if self.kv_tiers is not None and self.kv_tiers.has_pending() and not admitted:
                self.kv_tiers.wait(LOAD_WAIT_S)  # nothing to run until a load is read: no busy loop
            self.keep_alive()
            return list(admitted.values())
        sampling = [c for c in chunks if c.samples]
        self.runner.layer_hook = self.kv_exporter.layer_hook_for(chunks)
        self.runner.exports = self.kv_exporter.spans  # the other ranks send their heads of the same blocks
        speculating = any(c.proposal for c in sampling)
        try:
            logits, stats = self.runner.execute(chunks)
            first_rows = _first_rows(sampling) if speculating else None  # each request's last known token's row
            head = logits if first_rows is None else logits[long_tensor(first_rows, logits.device)]
            result = self.sampler.sample(head, [c.request for c in sampling], self.runner.score_prompts(chunks))
        except Exception as exc:  # whatever the forward raised, these requests cannot go on
            self.kv_exporter.discard()
            logger.exception("forward step failed; failing its %d requests", len(chunks))
            message = f"forward step failed: {type(exc).__name__}: {exc}"
            return merge_outputs(admitted, [self._fail(c.request, message, "worker_error") for c in chunks])
        self.kv_exporter.commit()
        self.step_stats.append(stats)
        if self.speculator is not None and self.speculator.step_times is not None and not stats.num_prefill_tokens:
            self.speculator.step_times.observe(stats.num_tokens, stats.duration_s)  # what a verified row costs now
        failed = {c.request.request_id for c, error in zip(sampling, result.errors) if error is not None}
        for chunk in chunks:
            if chunk.request.request_id not in failed:  # a failed row's KV may be what went wrong: never cache it
                # a proposal's KV counts once verified (``_verify``)
                chunk.request.num_computed_tokens = chunk.end - len(chunk.proposal)
                self.scheduler.register_full_blocks(chunk.request)
                self.scheduler.release_behind_window(chunk.request)
                entries = result.prompt_logprobs.get(chunk.request.request_id)
                if entries:
                    chunk.request.prompt_logprobs = (chunk.request.prompt_logprobs or [None]) + entries
        rows = zip(sampling, result.token_ids, result.errors, result.logprobs)
        outputs = [self._sampled(chunk.request, token, error, logprob) for chunk, token, error, logprob in rows]
        if first_rows is not None:
            outputs = self._verify(sampling, first_rows, logits, outputs)
        return merge_outputs(admitted, outputs) if admitted else outputs

    # ---- speculative decoding (engine.speculative) --------------------------------------------------------------

    def _proposals(self) -> dict[str, list[int]]:
        """Proposed tokens for the running requests that decode, within what max_tokens and the length limit leave."""
        speculator = self.speculator
        assert speculator is not None
        candidates = []
        for request in self.scheduler.running:
            if request.num_tokens - request.num_computed_tokens != 1 or not request.params.speculative:
                continue
            # the step makes one token whatever happens; each accepted proposed token makes one more
            limit = min(
                request.params.max_tokens - len(request.output_token_ids) - 1,
                self.length_limit - request.num_tokens - 1,
            )
            candidates.append((request, limit))
        bound = speculator.config.disable_above_batch
        if not candidates or (bound is not None and len(candidates) > bound):
            return {}
        return speculator.propose_all(candidates)

    def _verify(
        self, sampling: list[ScheduledChunk], first_rows: list[int], logits: torch.Tensor, outputs: list[RequestOutput]
    ) -> list[RequestOutput]:
        """Sample the proposed positions one at a time, each with its request's state after the tokens before it
        (penalties, grammar, seeded position, stop strings): a proposed token is kept while it is the token sampled
        at its position, and the first token sampled that differs (or the one after a fully kept proposal) ends the
        request's step. So greedy output is what it is without speculation; for sampled rows, drawing from the
        target and keeping the proposal when they agree is rejection sampling for a proposal of one certain token.
        Each request's KV then counts up to its last kept token; blocks grown for the rest go back."""
        speculator = self.speculator
        assert speculator is not None
        by_id = {output.request_id: output for output in outputs}
        checked = [(chunk, row) for chunk, row in zip(sampling, first_rows) if chunk.proposal]
        accepted = dict.fromkeys((chunk.request.request_id for chunk, _ in checked), 0)
        position = 0  # which proposed token is checked: its row is ``row + position + 1``
        live = checked
        while live := [
            (chunk, row)
            for chunk, row in live
            if chunk.request.status == RequestStatus.RUNNING
            and position < len(chunk.proposal)
            and chunk.request.output_token_ids[-1] == chunk.proposal[position]
        ]:
            position += 1
            for chunk, _ in live:  # the proposed token was right: its KV is the request's own
                request = chunk.request
                accepted[request.request_id] = position
                request.num_computed_tokens = chunk.start + position + 1
                self.scheduler.register_full_blocks(request)
            index = long_tensor([row + position for _, row in live], logits.device)
            requests = [chunk.request for chunk, _ in live]
            try:
                result = self.sampler.sample(logits[index], requests)
            except Exception as exc:  # as a failed forward: these requests cannot go on, the others can
                logger.exception("sampling proposed positions failed; failing %d requests", len(requests))
                message = f"sampling failed: {type(exc).__name__}: {exc}"
                for request in requests:
                    by_id[request.request_id] = self._fail(request, message, "worker_error")
                break
            for request, token, error, logprob in zip(requests, result.token_ids, result.errors, result.logprobs):
                output = self._sampled(request, token, error, logprob)
                by_id[request.request_id] = extend_output(by_id[request.request_id], output)
        for chunk, _ in checked:
            request = chunk.request
            speculator.verified(request, len(chunk.proposal), accepted[request.request_id])
            if request.status == RequestStatus.RUNNING:
                self.scheduler.release_behind_window(request)
                self.scheduler.rollback(request)
        return [by_id[output.request_id] for output in outputs]

    def save_evicted(self) -> None:
        """Blocks that left the prefix cache go down to the KV tiers, copied before anything overwrites them."""
        evicted = self.block_manager.evicted
        if evicted and self.kv_tiers is not None:
            self.kv_tiers.save(evicted)
        evicted.clear()

    def _finish_tier_loads(self) -> None:
        """Tier loads that were read: their pages go into the blocks of requests still waiting for them."""
        assert self.kv_tiers is not None
        for load in self.kv_tiers.poll():
            request = self.requests.get(load.request_id)
            if request is None or not request.num_loading_blocks:
                self.kv_tiers.drop(load)
                continue  # aborted meanwhile (``_finish`` cancels; this guards a reused id)
            loaded = self.kv_tiers.write(load)
            if request.status == RequestStatus.LOADING:
                self.scheduler.finish_load(request, loaded, load.counts_as_cached)
            else:  # a reservation's tier blocks: the rest of its prompt comes from the prefill worker
                self.kv_importer.tier_load_done(request, load, loaded)

    def _cancel_tier_load(self, request: Request) -> None:
        """Before a request's blocks are freed: its tier pages, when read, go nowhere."""
        if request.num_loading_blocks and self.kv_tiers is not None:
            self.kv_tiers.cancel(request.request_id)
        request.num_loading_blocks = 0

    def free_blocks(self, request: Request) -> None:
        """A live request's blocks go back (its KV transfer failed: it is computed afresh later)."""
        self._cancel_tier_load(request)
        self.block_manager.free(request.block_ids)

    def _sampled(
        self, request: Request, token_id: int | None, error: str | None, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        if token_id is None:
            return self._fail(request, error or "sampling failed", "sampling_error")
        export = request.kv_export
        if export is not None and not export.stream:  # a prefill-only request's one sample: its prompt is done
            try:
                self.kv_exporter.export_whole_prompt(request)
            except Exception as exc:  # the sink failed: this request's KV cannot reach its peer
                logger.exception("KV export of request %s failed", request.request_id)
                return self._fail(request, f"KV export failed: {type(exc).__name__}: {exc}", "worker_error")
        handoff = request.kv_import
        if handoff is not None and handoff.admitted_s is not None and handoff.first_decode_s is None:
            handoff.first_decode_s = self.clock()
        return self._append_token(request, token_id, logprob=logprob)

    def _admit_remote(self) -> dict[str, RequestOutput]:
        """The scheduler's admissions of hand-offs, each gaining the tokens its source made (their text already sent:
        ``new_token_ids`` is [] and ``text_delta`` continues after them); a prompt's may finish there (max_tokens=1,
        EOS)."""
        outputs: dict[str, RequestOutput] = {}
        for request in self.scheduler.admit_remote():
            handoff = request.kv_import
            assert handoff is not None  # the scheduler admits only joined ones
            for token_id in handoff.tokens:
                output = self._append_token(request, token_id, text_sent=True)
                if output.finished:
                    break
            output.new_token_ids = []
            outputs[request.request_id] = output
            if handoff.state is ImportState.RECOMPUTE:
                self.num_recomputes += 1
            elif not output.finished:
                self.scheduler.register_full_blocks(request)
        return outputs

    def _fail(self, request: Request, error: str, code: str) -> RequestOutput:
        """End a request with FinishReason.ERROR (blocks freed by ``_finish``); the output says why."""
        logger.warning("request %s failed: %s", request.request_id, error)
        request.error = error
        self.finish_request(request, FinishReason.ERROR)
        return error_output(request, error, code)

    def _append_token(
        self, request: Request, token_id: int, text_sent: bool = False, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """Add a sampled token and finish the request if it is done (``engine.outputs``). With ``text_sent`` (see
        ``add_token``) the grammar, fresh on a decode side, accepts the prefill worker's token all the same."""
        grammar = request.grammar
        if grammar is not None and not grammar.accept(token_id):  # the bitmask allowed it, so this is a bug
            return self._fail(request, f"token {token_id} does not match the request's grammar", "sampling_error")
        if request.timing.first_token_s is None:
            request.timing.first_token_s = self.clock()
        reason, delta = add_token(request, token_id, self.tokenizer, self.eos_token_ids, self.length_limit, text_sent)
        if reason is not None:
            self.finish_request(request, reason)
        return token_output(request, token_id, reason, delta, logprob, text_sent)

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.remove(request)
        self._cancel_tier_load(request)
        # the whole text, cut at a stop string
        request.output_text = detokenize(request, self.tokenizer, final=True).text
        request.finish_reason = reason
        request.timing.finished_s = self.clock()
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
        if request.status in (RequestStatus.PREFILLED, RequestStatus.FROZEN):
            self.release(request_id)
        else:
            self.finish_request(request, FinishReason.ABORT)
        return True

    def release(self, request_id: str) -> None:
        """Free a PREFILLED or FROZEN request's blocks once its KV has been exported (or its lease ended)."""
        request = self.requests.get(request_id)
        if request is None or request.status not in (RequestStatus.PREFILLED, RequestStatus.FROZEN):
            request = self._get(request_id, RequestStatus.PREFILLED)  # the error names what it is
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
        if self.speculator is not None:
            self.speculator.step_times = measure_step_times(self)
            if times := self.speculator.step_times:
                by_rows = {rows: round(seconds * 1000, 1) for rows, seconds in zip(times.rows, times.seconds)}
                logger.info("decode step ms by rows (what a verified proposal costs): %s", by_rows)
        self.block_manager.reset_prefix_cache()
        self.step_stats.clear()

    def has_unfinished(self) -> bool:
        """Work for ``step``: scheduled requests, or a KV-tier load behind a reservation to take in."""
        return self.scheduler.has_work() or (self.kv_tiers is not None and self.kv_tiers.has_pending())

    def keep_alive(self) -> None:
        """Rank 0 of a tensor-parallel engine with nothing to run: tell the other ranks it is alive (bounded rate)."""
        if self.runner.step_channel is not None and not self.runner.step_channel.group.broken:
            self.runner.step_channel.keep_alive()

    @property
    def health_problem(self) -> str:
        """Why this engine cannot run a step any more ("" while it can): its tensor-parallel group broke."""
        return self.tp_group.broken if self.tp_group is not None and self.tp_group.broken != "closed" else ""

    def close(self) -> None:
        """Finish the KV tiers' writes and leave their shared pool; tell the other ranks to stop and drop the group."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.tp_group is not None:
            if self.runner.step_channel is not None:
                try:
                    self.runner.step_channel.stop()
                except Exception:  # noqa: BLE001 - a broken group: the followers end on their own timeout
                    logger.warning("tensor-parallel stop was not delivered: %s", self.tp_group.broken)
            self.tp_group.close()

    def reconfigured(self, config: EngineConfig) -> LLMEngine:
        """This engine's weights under another config (a worker switching role keeps its model): a new engine whose
        KV cache, scheduler and runner ``config`` sizes. This one is closed and its cache freed first (a GPU holds one
        cache at a time), so it must not be used again. ValueError, with this engine untouched, while it holds a
        request or when the weights do not serve ``config`` (``engine_parts.check_same_weights``)."""
        if self.requests or self.scheduler.has_work():
            raise ValueError(f"the engine still holds {len(self.requests)} requests: it is rebuilt only when idle")
        check_same_weights(self.config, config)
        self.close()
        parts, cache = self._parts, self.kv_cache
        cache.kv, cache.k, cache.v = [], [], []  # the runner, importer and exporter share these lists' owner
        self.runner.decode_graphs = None  # CUDA graphs and compiled steps hold the old cache's tensors
        if self.config.device.startswith("cuda"):
            torch.cuda.empty_cache()
        rebuilt = rebuild_engine_parts(parts, config)
        return LLMEngine(rebuilt.config, None, rebuilt)

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
        if self.speculator is not None and self.speculator.draft is not None:
            self.speculator.draft.engine.check_no_leaks()

    def at_seq_limit(self) -> bool:
        """This engine holds ``max_num_seqs`` requests, so a reservation is refused: a decode step never exceeds the
        configured batch, which bounds the gather buffer and the KV plan (as vLLM caps its running batch)."""
        return len(self.requests) >= self.config.max_num_seqs

    # ---- a decoding request leaving for another worker (a move's source; its KV: ``kv_exporter.export_held``) ----

    def freeze(self, request_id: str) -> list[int]:
        """Stop a decoding request between steps, its blocks held (FROZEN), and return its generated tokens: its KV
        holds every token but the last. ValueError while it is still prefilling."""
        request = self._get(request_id, RequestStatus.RUNNING)
        if request.prefill_only or request.num_computed_tokens != request.num_tokens - 1:
            raise ValueError(f"request {request_id!r} is still prefilling: only a decoding request moves")
        self.scheduler.freeze(request)
        return list(request.output_token_ids)

    def resume(self, request_id: str) -> None:
        """A FROZEN request runs on here (its move was called off)."""
        self.scheduler.add_running(self._get(request_id, RequestStatus.FROZEN))

    # ---- fault injection ----------------------------------------------------------------------------------------

    def set_layer_hook(self, hook: LayerHook | None) -> None:
        """Fault injection: ``hook(layer, batch)`` runs after each layer's KV write, after the KV connector's exports.
        What it raises fails that step's requests; a sleep delays the forward (tests/cluster); None removes it."""
        self.kv_exporter.user_hook = hook


def _first_rows(sampling: list[ScheduledChunk]) -> list[int]:
    """The logits row of each sampling chunk's last known token (its proposed tokens' rows follow it)."""
    rows, offset = [], 0
    for chunk in sampling:
        rows.append(offset)
        offset += chunk.num_sampled_rows
    return rows
