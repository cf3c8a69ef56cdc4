"""Receiver-side bookkeeping shared by every backend: expectations, checks, sink calls, events.

Data flow on the decode side:
    decode worker reserves blocks -> receiver.expect(tid, dst_block_ids)       (state WAITING)
    backend receives a "kv" header -> InboundTable.admit(session, header)      (checks, claims blocks)
    backend has the payload bytes   -> InboundTable.complete(piece, bufs)      (sizes, xxh3, sink)
    every (layer, block) arrived    -> DONE event;   any TransferError -> FAILED event
    (``leading_run``: the sender fills the first blocks of those reserved, as many as it has, the same on every
    layer, and its finish ends the transfer: a running request's KV, whose length is known when it stops)
    deadline passes / abort          -> FAILED event
The table never blocks and never lets a piece write to a block that was not reserved for its transfer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from transfer.compress import dequantize_int8
from transfer.errors import PeerGone, ProtocolError, TransferError, TransferTimeout
from transfer.state import Inbound, TransferEvent, TransferState
from transfer.wire import ModelFingerprint, PieceHeader, check_piece, decode_frames, verify_tensors


class Sink(Protocol):
    """sink(transfer_id, layer, dst_block_ids, k, v, heads): write arrived blocks into the KV cache (``heads``: k and v
    hold only our heads [first, first + count), a tensor-parallel sender's share; None: all). k and v may be read-only
    views over the receive buffer, valid only during the call: copy them out."""

    def __call__(
        self,
        transfer_id: str,
        layer: int,
        block_ids: list[int],
        k: torch.Tensor,
        v: torch.Tensor,
        heads: tuple[int, int] | None = None,
        /,
    ) -> None: ...


class InboundTable:
    """All transfers this receiver expects; single-threaded (the thread that calls `poll()`)."""

    def __init__(
        self,
        fingerprint: ModelFingerprint,
        sink: Sink,
        max_frame_bytes: int,
        deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: what deadlines and silences are measured by (a simulation passes its own)."""
        self.fp = fingerprint
        self.clock = clock
        self.sink = sink
        self.max_frame_bytes = max_frame_bytes
        self.deadline_s = deadline_s
        self._tx: dict[str, Inbound] = {}
        self._events: deque[TransferEvent] = deque()

    # ------------------------------------------------------------------ lifecycle

    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        num_layers: int | None = None,
        deadline_s: float | None = None,
        leading_run: bool = False,
        heads: tuple[int, int] | None = None,
    ) -> None:
        """Announce a transfer: only these destination blocks, layers [0, num_layers), until deadline. With
        ``leading_run`` the sender fills a leading run of the blocks (the same on every layer) and its finish ends
        the transfer (``TransferEvent.num_blocks`` says how many it filled). ``heads``: every piece carries exactly
        these of our heads (one tensor-parallel sender's share of them)."""
        if transfer_id in self._tx:
            raise ValueError(f"transfer {transfer_id!r} already expected")
        in_order = tuple(int(b) for b in dst_block_ids)
        blocks = set(in_order)
        if not blocks or len(blocks) != len(in_order):
            raise ValueError("dst_block_ids must be non-empty and unique")
        layers = self.fp.num_layers if num_layers is None else int(num_layers)
        if not 0 < layers <= self.fp.num_layers:
            raise ValueError(f"num_layers {layers} out of range")
        if heads is not None and not (heads[1] > 0 and 0 <= heads[0] and heads[0] + heads[1] <= self.fp.num_kv_heads):
            raise ValueError(f"heads {heads} are not within our {self.fp.num_kv_heads}")
        now = self.clock()
        missing = [set(blocks) for _ in range(layers)]
        deadline = now + (deadline_s or self.deadline_s)
        self._tx[transfer_id] = Inbound(
            transfer_id,
            layers,
            deadline,
            now,
            missing,
            layers * len(blocks),
            in_order=in_order,
            leading_run=leading_run,
            heads=None if heads is None or tuple(heads) == (0, self.fp.num_kv_heads) else (heads[0], heads[1]),
        )

    def get(self, transfer_id: str) -> Inbound | None:
        return self._tx.get(transfer_id)

    def ids(self) -> list[str]:
        return list(self._tx)

    def items(self) -> list[Inbound]:
        return list(self._tx.values())

    def fail(self, transfer_id: str, error: TransferError) -> Inbound | None:
        """Terminal failure; returns the removed record (to NACK its sender) or None if unknown."""
        rec = self._tx.pop(transfer_id, None)
        if rec is not None:
            self._events.append(
                TransferEvent(transfer_id, TransferState.FAILED, error, rec.nbytes, self.clock() - rec.started)
            )
        return rec

    def heard(self, transfer_id: str, session: bytes) -> None:
        rec = self._tx.get(transfer_id)
        if rec is not None and rec.session == session:
            rec.last_heard = self.clock()

    def expire(self, silence_s: float | None = None) -> list[Inbound]:
        """Fail transfers past their deadline, and (with silence_s) bound to a sender that has not
        been heard from for silence_s: a killed prefill worker frees decode blocks in ~lease_s."""
        now = self.clock()
        out: list[Inbound | None] = []  # fail() finds each (the ids come from the table): no None in practice
        if silence_s is not None:
            for t, r in list(self._tx.items()):
                if r.session is not None and now - r.last_heard > silence_s:
                    out.append(self.fail(t, PeerGone(f"sender of transfer {t!r} silent for {silence_s}s (dead?)")))
        dead = [t for t, r in self._tx.items() if r.deadline < now]
        for t in dead:
            rec = self._tx[t]
            missing = sum(len(m) for m in rec.missing)
            err = TransferTimeout(
                f"transfer {t!r} missed its deadline in state {rec.state.name} ({missing} layer-blocks never arrived)"
            )
            out.append(self.fail(t, err))
        return [rec for rec in out if rec is not None]

    def drain(self) -> list[TransferEvent]:
        out = list(self._events)
        self._events.clear()
        return out

    # ------------------------------------------------------------------ pieces

    def admit(self, session: bytes, piece: PieceHeader) -> PieceHeader:
        """Check a "kv" header before its payload is used; claims its (layer, block) slots.

        Raises TransferError; the caller fails the transfer named in the header (if it is ours)."""
        rec = self._tx.get(piece.transfer_id)
        if rec is None:
            raise ProtocolError(f"unknown transfer {piece.transfer_id!r} (not expected, or already ended)")
        if rec.session is None:
            rec.session = session
        elif rec.session != session:
            raise ProtocolError("piece from a different sender session than the transfer's first")
        check_piece(piece, self.fp, self.max_frame_bytes)
        if piece.heads != rec.heads:
            raise ProtocolError(f"a piece of heads {piece.heads} for a transfer of heads {rec.heads}")
        if piece.layer >= rec.num_layers:
            raise ProtocolError(f"layer {piece.layer} beyond expected {rec.num_layers} layers")
        todo = rec.missing[piece.layer]
        if piece.blocks == rec.in_order and len(todo) == len(rec.in_order):
            todo.clear()  # the whole transfer's blocks for this layer, none arrived yet: one comparison, no sets
        else:
            blocks = set(piece.blocks)
            if len(blocks) != len(piece.blocks) or not blocks <= todo:
                bad = sorted(blocks - todo)[:8]
                raise ProtocolError(f"layer {piece.layer}: blocks {bad} not reserved for this transfer or duplicate")
            todo -= blocks
        rec.state = TransferState.TRANSFERRING
        rec.headers_seen += 1
        rec.last_heard = self.clock()
        return piece

    def complete(self, piece: PieceHeader, bufs: Sequence[Any]) -> None:
        """Verify payload bytes, write them through the sink, and finish the transfer if complete."""
        if piece.transfer_id not in self._tx:  # failed or aborted while the payload was in flight
            return
        self._finish_piece(piece, decode_frames(piece, bufs))

    def complete_tensors(self, piece: PieceHeader, tensors: Sequence[torch.Tensor]) -> None:
        """Same as complete() for payloads that arrived straight into tensors (nccl/gloo backend)."""
        if piece.transfer_id not in self._tx:
            return
        self._finish_piece(piece, verify_tensors(piece, tensors))

    def _finish_piece(self, piece: PieceHeader, tensors: Sequence[torch.Tensor]) -> None:
        rec = self._tx[piece.transfer_id]
        if piece.wire == "int8":
            k = dequantize_int8(tensors[0], tensors[1], self.fp.torch_dtype)
            v = dequantize_int8(tensors[2], tensors[3], self.fp.torch_dtype)
        else:
            k, v = tensors
        try:
            if piece.heads is None:
                self.sink(piece.transfer_id, piece.layer, list(piece.blocks), k, v)
            else:
                self.sink(piece.transfer_id, piece.layer, list(piece.blocks), k, v, piece.heads)
        except TransferError:
            raise
        except Exception as e:  # the sink is the engine's: report, don't crash the receiver
            raise TransferError(f"sink failed: {type(e).__name__}: {e}") from e
        self._count(rec, piece)

    def landed(self, piece: PieceHeader) -> None:
        """A piece its sender wrote into the reserved blocks itself, already checked (transfer/direct_path.py)."""
        rec = self._tx.get(piece.transfer_id)
        if rec is not None:
            self._count(rec, piece)

    def _count(self, rec: Inbound, piece: PieceHeader) -> None:
        rec.nbytes += sum(f.nbytes for f in piece.frames)
        rec.remaining -= len(piece.blocks)
        rec.pieces_done += 1
        self._maybe_end(rec)

    def on_finish(self, session: bytes, transfer_id: str, pieces: int) -> None:
        """The sender says it sent `pieces` pieces: lost or missing pieces fail now, not at deadline."""
        rec = self._tx.get(transfer_id)
        if rec is None:
            return
        if rec.session not in (None, session):
            raise ProtocolError("finish from a different sender session")
        if rec.headers_seen != pieces:
            raise ProtocolError(f"sender sent {pieces} pieces, {rec.headers_seen} arrived")
        rec.finish_pieces = pieces
        self._maybe_end(rec)

    def _maybe_end(self, rec: Inbound) -> None:
        finished = rec.finish_pieces is not None and rec.pieces_done == rec.finish_pieces
        if rec.leading_run:
            if finished:
                self._end(rec, _leading_run(rec))
        elif rec.remaining == 0:
            self._end(rec, len(rec.in_order))
        elif finished:
            missing = sum(len(m) for m in rec.missing)
            raise ProtocolError(f"sender finished with {missing} layer-blocks never sent")

    def _end(self, rec: Inbound, num_blocks: int) -> None:
        self._tx.pop(rec.transfer_id)
        rec.state = TransferState.DONE
        elapsed_s = self.clock() - rec.started
        self._events.append(TransferEvent(rec.transfer_id, TransferState.DONE, None, rec.nbytes, elapsed_s, num_blocks))


def _leading_run(rec: Inbound) -> int:
    """How many leading blocks of a ``leading_run`` transfer arrived, the same on every layer; ProtocolError when
    the sender filled none, a different run per layer, or left a gap."""
    filled = len(rec.in_order) - len(rec.missing[0])
    run = set(rec.in_order[:filled])
    if not filled or any(set(rec.in_order) - missing != run for missing in rec.missing):
        raise ProtocolError(f"sender finished without filling the same leading blocks on every layer ({filled} on 0)")
    return filled
