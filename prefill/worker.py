"""The prefill worker: computes prompts, streams their KV to decode workers, sends first tokens.

A thin adapter between the engine's KV connector, the transfer sender and the control plane; which blocks are
complete, and when, is the engine's business (``engine.kv_connector``), not this file's. A request's path:
1. ``prefill`` from the router: the request (prompt, sampling params, the decode worker's KV address and the block ids
   it reserved) enters the engine as a prefill-only request with a KV sink, and a transfer to that address begins.
   When the decode worker already holds the prompt's first ``cached_tokens`` (its prefix cache: a chat's history it
   just decoded), the engine exports only the blocks after them, and ``dst_blocks`` names only those.
2. The engine batches it with other prompts (ragged; chunked when longer than ``max_batch_tokens``) and reports its
   completed blocks to the sink, layer by layer inside the forward (``stream_layers``; else every layer once the
   prompt is done). The sink maps the request's logical blocks onto the decode worker's and hands them to the
   sender, so the bytes move while the remaining layers compute.
3. The step that finishes the prompt samples the first token; it goes to the router at once with its text (the TTFT
   point, not waiting for the transfer), its logprobs and the prompt's when asked for, and the prompt tokens this
   engine's prefix cache held; the transfer is marked finished.
4. The blocks stay held (PREFILLED) until the decode worker acknowledges the KV, or the lease runs out, or either side
   aborts: the sender's ``poll`` reports each of those once, and that is where the engine lets the request go.

Who reports a failed transfer: the side that decided it. A failure this side decided (the decode worker is gone,
the lease ran out) is reported from here as ``kv_transfer_failed``; one the decode side decided (a NACK) is reported
there; one the router already knows of (it aborted the request, or got this worker's own error first) is not
reported again. The decode side stays silent about what this sender aborted.
"""

from __future__ import annotations

import logging

from engine.blocks import blocks_for_tokens
from engine.kv_connector import KVBlocksReady, KVSink
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from transfer.base import KVSender, make_sender
from transfer.state import TransferEvent
from transfer.wire import ModelFingerprint
from worker.messages import Command, ErrorCode, Prefill, Tokens, WorkerCounters, WorkerLoad
from worker.role import Emit, Role, token_item
from worker.spec import WorkerRole, WorkerSpec

logger = logging.getLogger(__name__)


class PrefillRole(Role):
    kind = WorkerRole.PREFILL

    def __init__(
        self,
        name: str,
        engine: LLMEngine,
        sender: KVSender,
        emit: Emit,
        *,
        stream_kv: bool = True,
        counters: WorkerCounters | None = None,
    ) -> None:
        super().__init__(name, engine, emit, counters)
        self.sender = sender
        self.stream_kv = stream_kv  # False: every layer's KV once the whole prompt is done (the overlap baseline)
        # transfers whose end the router already knows of (it aborted them, or got this worker's error first):
        # their failure in poll() is not reported again. Added to when this side aborts a transfer; an entry leaves
        # when poll() reports that transfer's end, which it does exactly once for every transfer begun.
        self._known_to_router: set[str] = set()

    @classmethod
    def from_spec(cls, spec: WorkerSpec, engine: LLMEngine, emit: Emit) -> PrefillRole:
        sender = make_sender(spec.transfer_backend, ModelFingerprint.from_spec(engine.kv_spec), spec.transfer)
        return cls(spec.name, engine, sender, emit, stream_kv=spec.stream_layers)

    def handle(self, command: Command, arrival_s: float) -> None:
        if not isinstance(command, Prefill):
            return super().handle(command, arrival_s)
        rid, params = command.rid, command.params
        params.max_tokens = 1
        block_size = self.engine.kv_spec.block_size
        first_block = command.cached_tokens // block_size  # the engine refuses a count that is not whole blocks
        self.engine.add_request(
            command.prompt,
            params,
            rid,
            prefill_only=True,
            arrival_s=arrival_s,
            kv_sink=self._sink(rid, list(command.dst_blocks), first_block),
            stream_kv=self.stream_kv,
            export_from_token=command.cached_tokens,
        )
        num_prompt_tokens = self.engine.requests[rid].num_prompt_tokens
        if len(command.dst_blocks) < blocks_for_tokens(num_prompt_tokens, block_size) - first_block:
            self.engine.abort(rid)
            raise ValueError(f"decode reserved {len(command.dst_blocks)} blocks, the prompt needs more")
        try:
            self.sender.begin(rid, command.kv_address)
        except Exception:  # no transfer, so nothing would ever release the request: it ends here
            self.engine.abort(rid)
            raise

    def _sink(self, rid: str, dst_blocks: list[int], first_block: int) -> KVSink:
        """The request's KV sink: its logical blocks [first, end) go to the decode worker's reserved blocks, which
        start at logical block ``first_block`` (the engine reports none before it)."""
        sender = self.sender

        def send(ready: KVBlocksReady) -> None:
            dst = dst_blocks[ready.first_block - first_block : ready.end_block - first_block]
            sender.send_layer(rid, ready.layer, dst, ready.k, ready.v)

        return send

    def tick(self) -> None:
        first_tokens = []
        for output in self.engine.step():
            rid = output.request_id
            if output.error is not None:  # finish_reason ERROR: the engine has already freed the request's blocks
                # tell the router first (the client's error names the cause, not the aborted transfer), then abort
                # the transfer: its lease ends in poll() below, where there is nothing left to free
                self.counters.errors += 1
                self.emit_error(rid, output.error, ErrorCode.from_engine(output.error_code))
                self._abort_transfer(rid, output.error)
                continue
            if output.finish_reason is FinishReason.PREFILLED:
                self.sender.finish(rid)  # every layer of every block went to the sink before step() returned
                first_tokens.append(token_item(output))
        if first_tokens:  # to the router at once (the TTFT point), which forwards each token to its decode worker
            self.emit(Tokens(worker=self.name, items=first_tokens))
        for event in self.sender.poll():
            self._transfer_ended(event)

    def _transfer_ended(self, event: TransferEvent) -> None:
        """The lease ended (acknowledged, failed or aborted): the engine lets the request go, whatever its state (a
        request still computing stops: its KV has nowhere to go)."""
        rid = event.transfer_id
        self.engine.abort(rid)  # PREFILLED: released; still computing: aborted; gone: nothing to do
        known = rid in self._known_to_router
        self._known_to_router.discard(rid)
        if event.ok:
            self.counters.transfers_ok += 1
            self.counters.transfer_bytes += event.nbytes
            self.counters.transfer_seconds += event.elapsed_s
            return
        self.counters.transfers_failed += 1
        logger.info("%s: transfer %s failed: %s", self.name, rid, event.error)
        if not known and not getattr(event.error, "from_peer", False):
            # a failure this side decided (the decode side stays silent on what the sender aborted; it reports its
            # own NACKs, under its failure policy): the cause is reported from here
            self.emit_error(rid, f"KV transfer failed: {event.error}", ErrorCode.KV_TRANSFER_FAILED)

    def _abort_transfer(self, rid: str, reason: str) -> None:
        self._known_to_router.add(rid)
        self.sender.abort(rid, reason)  # its lease ends in poll(), which lets the request go

    def abort(self, rid: str) -> None:
        if rid in self.engine.requests:  # every request here has a transfer (begun right after it was added)
            self._abort_transfer(rid, "aborted by router")

    def health_problem(self) -> str:
        """A dead KV sender I/O thread: every transfer of this worker would fail, so it must get no new work."""
        return self.sender.io_problem()

    def load(self) -> WorkerLoad:
        load = super().load()
        load.leased_transfers = len(self.sender.active_transfers())
        return load

    def close(self) -> None:
        self.sender.close()
