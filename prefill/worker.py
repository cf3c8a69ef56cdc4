"""The prefill worker: computes prompts, streams their KV to decode workers, sends first tokens.

A thin adapter between the engine's KV connector (which decides what is complete, and when), the transfer sender and
the control plane. ``prefill`` becomes a prefill-only engine request whose KV sink maps each completed block range
(after the decode worker's ``cached_tokens``) onto the decode worker's reserved blocks and sends it, layer by layer
inside the forward (``stream_layers``), while the later layers compute. The first token goes to the router at once
(the TTFT point); the blocks stay held (PREFILLED) until ``poll`` reports the lease's end (acknowledged, expired,
aborted). A failed transfer is reported by the side that decided it (docs/architecture.md "Failure handling").
"""

from __future__ import annotations

import logging

from engine.blocks import blocks_for_tokens
from engine.llm_engine import LLMEngine
from engine.request import FinishReason
from transfer.base import KVSender
from transfer.state import TransferEvent
from worker.handoff_join import HandoffSender
from worker.messages import Command, ErrorCode, Prefill, Tokens, WorkerCounters, WorkerLoad
from worker.rank_kv import handoff_layout, rank_kv
from worker.role import Emit, Role, token_item
from worker.spec import WorkerRole, WorkerSpec

logger = logging.getLogger(__name__)


class PrefillRole(Role):
    kind = WorkerRole.PREFILL

    def __init__(
        self,
        name: str,
        engine: LLMEngine,
        sender: HandoffSender | KVSender,
        emit: Emit,
        *,
        stream_kv: bool = True,
        counters: WorkerCounters | None = None,
    ) -> None:
        """``sender``: the worker's (``from_spec``), or a plain one of a worker of one rank (its receivers hold
        every head)."""
        super().__init__(name, engine, emit, counters)
        if not isinstance(sender, HandoffSender):
            sender = HandoffSender.over(sender, handoff_layout(engine.kv_spec, engine.runner.head_split))
        self.sender = sender
        self.stream_kv = stream_kv  # False: every layer's KV once the whole prompt is done (the overlap baseline)
        # transfers whose end the router already knows of (it aborted, or got this worker's error first): poll()
        # does not report their failure, and drops each entry when it reports that transfer's end (once per transfer)
        self._known_to_router: set[str] = set()

    @classmethod
    def from_spec(cls, spec: WorkerSpec, engine: LLMEngine, emit: Emit) -> PrefillRole:
        # this rank's senders (the other ranks send their heads themselves: worker/tp_rank.py)
        kv = rank_kv(spec, engine.kv_cache, handoff_layout(engine.kv_spec, engine.runner.head_split), None)
        sender = HandoffSender(kv, engine.runner.step_channel)
        return cls(spec.name, engine, sender, emit, stream_kv=spec.stream_layers)

    def handle(self, command: Command, arrival_s: float) -> None:
        if not isinstance(command, Prefill):
            return super().handle(command, arrival_s)
        rid, params = command.rid, command.params
        params.max_tokens = 1
        block_size = self.engine.kv_spec.block_size
        first_block = command.cached_tokens // block_size  # the engine refuses a count that is not whole blocks
        dst_blocks = list(command.dst_blocks)
        sink = self.sender.sink(rid, dst_blocks, first_block)
        if self.spans is not None:
            sink = self.spans.layer_sink(rid, sink)
        self.engine.add_request(
            command.prompt,
            params,
            rid,
            prefill_only=True,
            arrival_s=arrival_s,
            kv_sink=sink,
            stream_kv=self.stream_kv,
            export_from_token=command.cached_tokens,
        )
        num_prompt_tokens = self.engine.requests[rid].num_prompt_tokens
        if len(command.dst_blocks) < blocks_for_tokens(num_prompt_tokens, block_size) - first_block:
            self.engine.abort(rid)
            raise ValueError(f"decode reserved {len(command.dst_blocks)} blocks, the prompt needs more")
        try:
            self.sender.begin(rid, command.kv_address, dst_blocks, first_block)
        except Exception:  # no transfer, so nothing would ever release the request: it ends here
            self.engine.abort(rid)
            raise

    def tick(self) -> None:
        first_tokens = []
        for output in self.engine.step():
            rid = output.request_id
            if output.error is not None:  # finish_reason ERROR: the engine has already freed the request's blocks
                # tell the router first (the error names the cause, not the aborted transfer); the lease ends in poll()
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
        """The lease ended (acknowledged, failed or aborted): the engine lets the request go, whatever its state."""
        rid = event.transfer_id
        self.engine.abort(rid)  # PREFILLED: released; still computing: aborted; gone: nothing to do
        known = rid in self._known_to_router
        self._known_to_router.discard(rid)
        if self.spans is not None:
            error = None if event.error is None else str(event.error)
            self.spans.on_transfer_end(rid, event.ok, event.nbytes, event.elapsed_s, error, self.sender.paths())
        if event.ok:
            self.counters.transfers_ok += 1
            self.counters.transfer_bytes += event.nbytes
            self.counters.transfer_seconds += event.elapsed_s
            return
        self.counters.transfers_failed += 1
        logger.info("%s: transfer %s failed: %s", self.name, rid, event.error)
        if not known and not getattr(event.error, "from_peer", False):
            # a failure this side decided (the decode side reports only its own NACKs): the cause is reported here
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

    def kv_paths(self) -> dict[str, str]:
        return self.sender.paths()

    def load(self) -> WorkerLoad:
        load = super().load()
        load.leased_transfers = len(self.sender.active_transfers())
        return load

    def close(self) -> None:
        self.sender.close()
