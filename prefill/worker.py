"""The prefill worker: computes prompts, streams their KV to decode workers layer by layer, sends first tokens.

A request's path through this worker:
1. ``prefill`` command from the router: the request (prompt, sampling params, the decode worker's KV address and
   the block ids it reserved) enters the engine as a prefill-only request, and a transfer to that address begins.
2. The engine batches it with other prompts (ragged; chunked when longer than ``max_batch_tokens``). In every forward,
   the layer hook runs after each layer's KV lands in the cache and hands the transfer sender that layer's blocks
   that are now complete, so the bytes move while the remaining layers compute.
3. The step that finishes the prompt samples the first token; it goes to the router at once with its text (the TTFT
   point, not waiting for the transfer), and the transfer is marked finished.
4. The blocks stay held (PREFILLED) until the decode worker acknowledges the KV, or the lease runs out, or either side
   aborts: the sender's ``poll`` reports each of those once, and that is where the blocks are released.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from worker.messages import Command, ErrorCode, FirstToken, Prefill, Stats
from worker.runtime import WorkerRuntime, finish_timing
from worker.spec import WorkerSpec
from engine.attention import AttentionBatch
from engine.request import RequestStatus
from transfer.base import make_sender
from transfer.wire import ModelFingerprint

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class OutboundKV:
    """Which of a request's blocks have been handed to the sender (every layer of a forward sends the same range)."""

    dst_blocks: list[int]
    num_prompt_tokens: int
    blocks_sent: int = 0


class PrefillWorker(WorkerRuntime):
    role = "prefill"

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec)  # self.spec: resolved in this process (device chosen)
        stream_layers = self.stream_layers = self.spec.stream_layers
        self.fingerprint = ModelFingerprint.from_spec(self.engine.kv_spec)
        self.sender = make_sender(self.spec.transfer_backend, self.fingerprint, self.spec.transfer)
        self.outbound: dict[str, OutboundKV] = {}
        # transfers whose end the router already knows of (it aborted them, or got this worker's error first):
        # their failure in poll() is not reported again
        self._known_to_router: set[str] = set()
        if stream_layers:
            self.engine.set_layer_hook(self._on_layer)

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.outbound)

    def handle(self, command: Command, arrival_s: float) -> None:
        if not isinstance(command, Prefill):
            return super().handle(command, arrival_s)
        rid, params = command.rid, command.params
        params.max_tokens = 1
        self.engine.add_request(command.prompt, params, rid, prefill_only=True, arrival_s=arrival_s)
        num_prompt = len(self.engine.requests[rid].prompt_token_ids)
        dst_blocks = command.dst_blocks
        if len(dst_blocks) < self.engine.block_manager.blocks_for(num_prompt):
            self.engine.abort(rid)
            raise ValueError(f"decode reserved {len(dst_blocks)} blocks, the prompt needs more")
        self.outbound[rid] = OutboundKV(dst_blocks, num_prompt)
        self.sender.begin(rid, command.kv_address)

    def _on_layer(self, layer: int, batch: AttentionBatch) -> None:
        block_size = self.engine.kv_spec.block_size
        last_layer = layer == self.engine.kv_spec.num_layers - 1
        for chunk in batch.chunks:
            out = self.outbound.get(chunk.request.request_id)
            if out is None:
                continue
            # a block is sent once, when full, or at the end of the prompt when it is the partial last block
            if chunk.end >= out.num_prompt_tokens:
                upto = -(-out.num_prompt_tokens // block_size)
            else:
                upto = chunk.end // block_size
            if upto > out.blocks_sent:
                src = chunk.request.block_ids[out.blocks_sent : upto]
                k, v = self.engine.read_kv_blocks(layer, src)
                self.sender.send_layer(chunk.request.request_id, layer, out.dst_blocks[out.blocks_sent : upto], k, v)
            if last_layer:
                out.blocks_sent = max(out.blocks_sent, upto)

    def _send_all_layers(self, rid: str) -> None:
        """stream_layers=False: the whole prompt's KV, layer by layer, once the prefill is over."""
        out = self.outbound[rid]
        src = self.engine.requests[rid].block_ids[: len(out.dst_blocks)]
        num_blocks = -(-out.num_prompt_tokens // self.engine.kv_spec.block_size)
        for layer in range(self.engine.kv_spec.num_layers):
            k, v = self.engine.read_kv_blocks(layer, src[:num_blocks])
            self.sender.send_layer(rid, layer, out.dst_blocks[:num_blocks], k, v)

    def tick(self) -> None:
        for output in self.engine.step():
            if output.error is not None:  # finish_reason ERROR: the engine has already freed the request's blocks
                # tell the router first (the client's error names the cause, not the aborted transfer), then abort
                # the transfer: its lease ends in poll() below, where _release finds nothing left to free
                self.counters.errors += 1
                self.emit_error(output.request_id, output.error, ErrorCode.from_engine(output.error_code))
                if output.request_id in self.outbound:
                    self._known_to_router.add(output.request_id)
                    self.sender.abort(output.request_id, output.error)
                continue
            request = self.engine.requests.get(output.request_id)
            if output.finish_reason is None or request is None:
                continue
            if not self.stream_layers:
                self._send_all_layers(output.request_id)
            self.sender.finish(output.request_id)
            timing = finish_timing(request)
            # end_mono: when the first token was sampled, the same point whether the KV was streamed or not
            timing.end_mono = request.first_token_s
            # text: the first token's text; the decode worker continues from it
            self.emit(FirstToken(rid=output.request_id, worker=self.name, token=output.new_token_ids[0],
                                 text=output.text_delta, timing=timing))
        for event in self.sender.poll():
            self._release(event.transfer_id)
            if event.ok:
                self.counters.transfers_ok += 1
                self.counters.transfer_bytes += event.nbytes
                self.counters.transfer_seconds += event.elapsed_s
            else:
                self.counters.transfers_failed += 1
                logger.info("%s: transfer %s failed: %s", self.name, event.transfer_id, event.error)
                if event.transfer_id not in self._known_to_router and not getattr(event.error, "from_peer", False):
                    # a failure this side decided (the decode side stays silent on what the sender aborted; it
                    # reports its own NACKs, under its failure policy): the cause is reported from here
                    self.emit_error(event.transfer_id, f"KV transfer failed: {event.error}",
                                    ErrorCode.KV_TRANSFER_FAILED)
            self._known_to_router.discard(event.transfer_id)

    def _release(self, rid: str) -> None:
        self.outbound.pop(rid, None)
        request = self.engine.requests.get(rid)
        if request is None:
            return
        if request.status == RequestStatus.PREFILLED:
            self.engine.release(rid)
        else:  # the transfer ended before the prompt did (decode gone, aborted): stop computing it
            self.engine.abort(rid)

    def abort(self, rid: str) -> None:
        if rid in self.outbound:
            self._known_to_router.add(rid)
            self.sender.abort(rid, "aborted by router")  # its lease ends in poll(), which releases the blocks
        else:
            self.engine.abort(rid)

    def health_problem(self) -> str:
        """A dead KV sender I/O thread: every transfer of this worker would fail, so it must get no new work."""
        return self.sender.io_problem()

    def stats(self) -> Stats:
        stats = super().stats()
        stats.load.leased_transfers = len(self.outbound)
        return stats

    def close(self) -> None:
        self.sender.close()
        super().close()
