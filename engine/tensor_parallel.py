"""Tensor parallelism inside one engine: N ranks, each holding a slice of every layer and its own KV heads.

Each rank holds the shard the model's own plan cuts (``engine.tp_shard``, Megatron's split): row-parallel linears end
in one all-reduce (``RowParallel``), and only rank 0 projects to the vocabulary and samples. Rank 0 runs the whole
engine (scheduler, block manager, sampler); before each forward it broadcasts the step (``StepMessage``: int64 frames, no pickle) and every other rank runs the same
forward on the same block ids (``TPFollower``). Two groups per worker (``TPGroup``): the layers' all-reduces on the
device group (NCCL on CUDA, gloo on the CPU), the step messages on a CPU group. KV heads split like the q heads; when
there are fewer KV heads than ranks, each rank keeps the one its q heads read, as vLLM does. Every collective waits
at most ``timeout_s``; an idle rank 0 sends a keep-alive so that a follower that hears nothing knows rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _functional
import xxhash
from torch.distributed.distributed_c10d import GroupName

from engine.blocks import rank_kv_heads
from engine.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from engine.attention import LayerHook
    from engine.kv_cache import KVCache
    from engine.request import Request

logger = logging.getLogger(__name__)
KEEPALIVE_INTERVAL_S = 1.0  # rank 0, idle, at most this long between messages
TP_TIMEOUT_S = 30.0  # one collective, or a follower's wait for the next message
TP_START_TIMEOUT_S = 900.0  # every rank's shard loaded: ranks load at their own pace (a large model, a slow disk)


class TPError(RuntimeError):
    """A collective failed or timed out: the group is broken and the whole worker must go."""


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """Which attention heads one rank of ``size`` holds: q heads ``[q_start, q_start + q_heads)``, KV heads likewise.
    ``degree``: the ways the heads are cut, ``size`` or 1 (attention whole on every rank: a plan that leaves it
    uncut, or ranks that split only a mixture's experts, ``engine.expert_parallel``)."""

    rank: int
    size: int
    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int
    kv_total: int  # the model's KV heads
    degree: int  # the ways the heads are cut: ``size``, or 1

    @property
    def replicated_kv(self) -> bool:
        """Several ranks hold the same KV head (fewer KV heads than ranks, or attention whole on several)."""
        return self.kv_heads * self.size > self.kv_total

    @property
    def holders(self) -> int:
        """The consecutive ranks that hold the same KV heads (``head_split``)."""
        return self.kv_heads * self.size // self.kv_total if self.replicated_kv else 1

    def local_kv(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's heads of KV holding every head of the model (heads on dim -2)."""
        return kv[..., self.kv_start : self.kv_start + self.kv_heads, :]

    def whole_kv(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Every head of the model, in order, from each rank's part (rank order; heads on dim -2). Replicated, a head
        is held by ``holders`` consecutive ranks: the first of them gives it."""
        return torch.cat(parts[:: self.holders], dim=-2)


def head_split(num_heads: int, num_kv_heads: int, size: int, rank: int, degree: int | None = None) -> HeadSplit:
    """Rank ``rank``'s heads of ``size`` ranks that cut them ``degree`` ways (default ``size``; 1: every rank holds
    every head); ValueError naming ``tensor_parallel_size`` when it cannot split."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    if degree not in (None, size, 1):
        raise ValueError(f"the heads of {size} ranks are cut {size} ways or whole on each, not {degree}")
    if degree == 1 and size > 1:
        return HeadSplit(rank, size, 0, num_heads, 0, num_kv_heads, num_kv_heads, 1)
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} and the model's {num_kv_heads} KV heads: one must divide the other"
        )
    q_heads = num_heads // size
    q_start = rank * q_heads
    kv_heads = rank_kv_heads(num_kv_heads, size)
    if num_kv_heads >= size:
        kv_start = rank * kv_heads
    else:  # fewer KV heads than ranks: the one KV head this rank's q heads attend with, replicated
        kv_start = q_start // (num_heads // num_kv_heads)
    return HeadSplit(rank, size, q_start, q_heads, kv_start, kv_heads, num_kv_heads, size)


def group_backends(device: torch.device | str) -> tuple[str, str]:
    """The backends of a worker's two groups for ranks on ``device``: the device group carries the layers'
    collectives (NCCL on CUDA tensors, gloo on host ones: the same calls), the CPU group the step messages and the
    control (gloo, host int64 frames), as vLLM keeps a device and a CPU group."""
    return ("nccl" if torch.device(device).type == "cuda" else "gloo"), "gloo"


class TPGroup:
    """One rank's view of its worker's two groups: the device group for the layers' all-reduces, the CPU group for
    the step messages, the KV endpoints' control and the start barrier. Every wait is bounded
    by ``timeout_s``; a failure breaks both and aborts them, so no op outlives a dead rank. The device group is also
    registered by name, so the compiled decode step (and a CUDA graph) carries its all-reduces as functional
    collectives (``RowParallel``). NCCL's process-wide settings are the process's own (transfer/nccl_env.py, set by
    the pool at the worker's start)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout_s: float,
        host: str = "127.0.0.1",
        device: torch.device | str = "cpu",
    ) -> None:
        self.rank, self.size = rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.broken = ""  # why the group can no longer be used ("" while it can)
        self.device = torch.device(device)
        self.device_backend, _ = group_backends(self.device)
        # the ranks' rendezvous waits as long as their start may take; each collective then waits ``timeout_s``
        start_timeout = max(self.timeout, datetime.timedelta(seconds=TP_START_TIMEOUT_S))
        self._cpu = _gloo_group(dist.PrefixStore("pdserve-tp-cpu", store), rank, size, start_timeout, host)
        device_store = dist.PrefixStore("pdserve-tp-device", store)
        if self.device_backend == "nccl":
            self._device = _nccl_group(device_store, rank, size, start_timeout, self.device)
        else:
            self._device = _gloo_group(device_store, rank, size, start_timeout, host)
        # what a compiled step's functional all-reduce names (one per group object: ranks may be threads of one
        # process, each with a group of its own)
        self.device_group_name = GroupName(f"pdserve-tp-device-{id(self):x}-r{rank}")
        self._device._set_group_name(self.device_group_name)
        torch._C._distributed_c10d._register_process_group(self.device_group_name, self._device)

    def _run(self, what: str, issue: Callable[[], Any], timeout: datetime.timedelta | None = None) -> None:
        """Issue a collective and wait for it, at most ``timeout`` (the group's); a failure breaks the group. On NCCL
        the wait orders this thread's stream after the op; the step's end waits for that stream, bounded
        (``wait_device``)."""
        if self.broken:
            raise TPError(f"tensor-parallel group is broken: {self.broken}")
        try:
            issue().wait(timeout or self.timeout)
        except RuntimeError as exc:
            self._break(f"{what} failed on rank {self.rank}: {exc}")
            raise TPError(self.broken) from exc

    def _break(self, why: str) -> None:
        self.broken = self.broken or why[:300]
        self._abort()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place, on the device group."""
        self._run("all-reduce", lambda: self._device.allreduce([tensor]))
        return tensor

    def all_to_all(
        self, output: torch.Tensor, tensor: torch.Tensor, output_rows: list[int], input_rows: list[int]
    ) -> torch.Tensor:
        """Rows ``input_rows[r]`` of ``tensor`` to rank r, in rank order; ``output`` gets ``output_rows[r]`` rows from
        rank r (an expert-parallel layer's dispatch and combine), on the device group."""
        self._run("all-to-all", lambda: self._device.alltoall_base(output, tensor, output_rows, input_rows))
        return output

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on each), stacked on dim 0 in rank order, on the device group."""
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self._run("all-gather", lambda: self._device.allgather([parts], [tensor]))
        return torch.cat(parts)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's host ``tensor`` (a step message) onto every rank, in place, on the CPU group."""
        self._run("broadcast", lambda: self._cpu.broadcast([tensor], _root(dist.BroadcastOptions())))
        return tensor

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` on rank 0, in rank order ([] on the others), on the CPU group: the followers'
        answers to a control message (their KV endpoints' news)."""
        length = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [[torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]] if self.rank == 0 else []
        self._run("gather", lambda: self._cpu.gather(lengths, [length], _root(dist.GatherOptions())))
        longest = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            longest[0] = max(int(t) for t in lengths[0])
        self._run("broadcast", lambda: self._cpu.broadcast([longest], _root(dist.BroadcastOptions())))
        size = int(longest[0])
        if size == 0:
            return [b""] * self.size if self.rank == 0 else []
        mine = torch.zeros(size, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outputs = [[torch.zeros(size, dtype=torch.uint8) for _ in range(self.size)]] if self.rank == 0 else []
        self._run("gather", lambda: self._cpu.gather(outputs, [mine], _root(dist.GatherOptions())))
        if self.rank != 0:
            return []
        return [bytes(t[: int(n)].numpy()) for t, n in zip(outputs[0], lengths[0])]

    def barrier(self, timeout_s: float = TP_START_TIMEOUT_S) -> None:
        """Wait until every rank gets here (after loading its shard), at most ``timeout_s``, on the CPU group."""
        opts = dist.BarrierOptions()
        opts.timeout = datetime.timedelta(seconds=timeout_s)
        self._run("start barrier", lambda: self._cpu.barrier(opts), opts.timeout)

    def wait_device(self) -> None:
        """The end of a step on an NCCL device group: this thread's stream (the step's collectives in it) done
        within the group's timeout, never a device-wide synchronize; else the groups are aborted and broken."""
        if self.device_backend != "nccl":
            return
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.timeout.total_seconds()
        while not done.query():
            if time.monotonic() > deadline:
                self._break(f"a step's collectives did not finish within {self.timeout.total_seconds():.0f} s")
                raise TPError(self.broken)
            time.sleep(0.0001)

    def close(self) -> None:
        """Drop the groups' connections (a peer waiting on them fails instead of hanging)."""
        self.broken = self.broken or "closed"
        self._abort()

    def _abort(self) -> None:
        for pg in (self._device, self._cpu):
            with contextlib.suppress(RuntimeError, AttributeError):  # already aborted, or a backend without abort
                pg.abort()
        with contextlib.suppress(RuntimeError, AttributeError, KeyError):
            torch._C._distributed_c10d._unregister_process_group(self.device_group_name)


def _root(opts: Any) -> Any:
    opts.rootRank = 0
    return opts


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, host: str) -> Any:
    """A process group of one gloo backend (a ``ProcessGroup``, so functional collectives can name it)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private: no stub; sets the timeout
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    backend = dist.ProcessGroupGloo(store, rank, size, opts)
    return _wrap(store, rank, size, torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)


def _nccl_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, device: torch.device) -> Any:
    """An NCCL process group bound to this rank's GPU: its collectives run on device tensors, no host round trip."""
    if not dist.is_nccl_available():
        raise TPError("tensor parallelism on CUDA needs a torch build with NCCL")
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    backend = dist.ProcessGroupNCCL(store, rank, size, opts)
    return _wrap(store, rank, size, device, dist.ProcessGroup.BackendType.NCCL, backend)


def _wrap(store: dist.Store, rank: int, size: int, device: torch.device, kind: Any, backend: Any) -> Any:
    pg = dist.ProcessGroup(store, rank, size)
    pg._register_backend(torch.device(device.type), kind, backend)
    pg._set_default_backend(kind)
    return pg


class RowParallel(torch.nn.Module):
    """A row-parallel linear: this rank's input slice times its weight columns, summed over the ranks."""

    def __init__(self, linear: torch.nn.Linear, group: TPGroup) -> None:
        super().__init__()
        self.linear = linear
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.linear(x)
        if torch.compiler.is_compiling() or _capturing(partial):  # one graph with its all-reduces inside
            return _functional.all_reduce(partial, "sum", self.group.device_group_name)
        return self.group.all_reduce(partial)


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


class StepKind(enum.IntEnum):
    STEP = 1
    KEEPALIVE = 2
    STOP = 3
    CONTROL = 4  # the worker's KV endpoints on every rank: a message of its own (bytes), maybe with replies gathered
    TIERS = 5  # the KV tiers on every rank (engine.rank_tiers): as CONTROL


BYTE_KINDS = (StepKind.CONTROL, StepKind.TIERS)  # a message of bytes for the followers' endpoints


@dataclass(frozen=True, slots=True)
class HandoffPart:
    """One sender rank's share of one receiver rank's KV heads in a hand-off between tensor-parallel workers: its
    ``count`` heads from the sender's local head ``sender_first`` go into the receiver's local head
    ``receiver_first``."""

    sender_rank: int
    receiver_rank: int
    sender_first: int
    receiver_first: int
    count: int


def handoff_parts(
    num_heads: int, num_kv_heads: int, sender_degree: int, receiver_degree: int, receiver_ranks: int | None = None
) -> list[HandoffPart]:
    """Who sends which heads to whom when a worker whose ranks cut the heads ``sender_degree`` ways hands KV to one of
    ``receiver_ranks`` ranks (default ``receiver_degree``) that cut them ``receiver_degree`` ways (1: each rank holds
    every head): each receiver rank gets each of its heads from the first sender rank that holds it (a head
    replicated over several sender ranks is sent once; a sender whose ranks hold every head sends from rank 0), in
    runs of consecutive heads. Both ends compute the same list."""
    ranks = receiver_ranks or receiver_degree
    senders = [head_split(num_heads, num_kv_heads, sender_degree, r) for r in range(sender_degree)]
    parts: list[HandoffPart] = []
    for receiver in (head_split(num_heads, num_kv_heads, ranks, r, receiver_degree) for r in range(ranks)):
        for local in range(receiver.kv_heads):
            head = receiver.kv_start + local
            owner = next(s for s in senders if s.kv_start <= head < s.kv_start + s.kv_heads)
            last = parts[-1] if parts else None
            if (
                last is not None
                and last.receiver_rank == receiver.rank
                and last.sender_rank == owner.rank
                and last.receiver_first + last.count == local
                and last.sender_first + last.count == head - owner.kv_start
            ):
                parts[-1] = HandoffPart(
                    owner.rank, receiver.rank, last.sender_first, last.receiver_first, last.count + 1
                )
            else:
                parts.append(HandoffPart(owner.rank, receiver.rank, head - owner.kv_start, local, 1))
    return parts


def export_slot(request_id: str) -> int:
    """A streamed export's number in the step message (int64), the same on every rank: the hand-off's id hashed, so
    a follower finds the hand-off its ``ExportSpan`` belongs to from what rank 0 told it when the hand-off began."""
    return xxhash.xxh3_64_intdigest(request_id.encode()) - (1 << 63)


@dataclass(frozen=True, slots=True)
class ExportSpan:
    """Logical blocks ``[first_block, end_block)`` of the request exported under ``slot`` (``export_slot`` of its
    id), at ``block_ids``, hold their final KV in this step: each rank sends its heads of them."""

    slot: int
    first_block: int
    end_block: int
    block_ids: list[int]


@dataclass(slots=True)
class StepRequest:
    """What a follower knows of one request in a step: its block table and the step's tokens."""

    block_ids: list[int]
    start: int
    token_ids: list[int]
    num_tokens: int  # end + 1 when the chunk does not sample, so ``ScheduledChunk.samples`` reads the same
    wants_prompt_logprobs: bool = False

    def token_slice(self, start: int, end: int) -> list[int]:
        return self.token_ids[start - self.start : end - self.start]


@dataclass(slots=True)
class StepMessage:
    """A message to the followers as int64 frames: a header ``[kind, payload length]``, then for a STEP
    ``[num_exports, per export (slot, first, end, num_blocks, *block_ids)]`` and per chunk ``[start, num_tokens,
    samples, num_blocks, *block_ids, *token_ids]``; for a CONTROL or TIERS ``[reply, num_bytes, *bytes packed 8 a
    value]``.
    ``exports``: the blocks whose KV leaves this step (each rank sends its heads of them after each layer)."""

    kind: StepKind
    chunks: list[ScheduledChunk] = field(default_factory=list)
    exports: list[ExportSpan] = field(default_factory=list)
    control: bytes = b""  # CONTROL, TIERS: the message for the endpoints
    reply: bool = False  # CONTROL, TIERS: every follower answers with bytes, gathered on rank 0

    def encode(self) -> torch.Tensor:
        if self.kind in BYTE_KINDS:
            padded = self.control + b"\0" * (-len(self.control) % 8)
            body = (
                torch.frombuffer(bytearray(padded), dtype=torch.int64) if padded else torch.zeros(0, dtype=torch.int64)
            )
            return torch.cat((torch.tensor([int(self.reply), len(self.control)], dtype=torch.int64), body))
        if self.kind != StepKind.STEP:
            return torch.zeros(0, dtype=torch.int64)
        payload: list[int] = [len(self.exports)]
        for span in self.exports:
            payload += [span.slot, span.first_block, span.end_block, len(span.block_ids), *span.block_ids]
        for chunk in self.chunks:
            blocks = chunk.request.block_ids
            payload += [chunk.start, chunk.num_tokens, int(chunk.samples), len(blocks), *blocks]
            payload += chunk.token_ids()
        return torch.tensor(payload, dtype=torch.int64)

    @staticmethod
    def decode(kind: StepKind, payload: torch.Tensor) -> StepMessage:
        if kind in BYTE_KINDS:
            reply, length = int(payload[0]), int(payload[1])
            return StepMessage(kind, control=payload[2:].numpy().tobytes()[:length], reply=bool(reply))
        if kind != StepKind.STEP:
            return StepMessage(kind)
        values = payload.tolist()
        exports, i = [], 1
        for _ in range(values[0]):
            slot, first, end, count = values[i : i + 4]
            exports.append(ExportSpan(slot, first, end, values[i + 4 : i + 4 + count]))
            i += 4 + count
        chunks = []
        while i < len(values):
            start, num_tokens, samples, num_blocks = values[i : i + 4]
            i += 4
            blocks = values[i : i + num_blocks]
            i += num_blocks
            tokens = values[i : i + num_tokens]
            i += num_tokens
            end = start + num_tokens
            request = StepRequest(blocks, start, tokens, end if samples else end + 1)
            chunks.append(ScheduledChunk(cast("Request", request), start, num_tokens))
        return StepMessage(kind, chunks, exports)


class StepChannel:
    """Rank 0 announces each step (or a keep-alive, a control message of the worker's KV endpoints, the stop); the
    others receive it, bounded by the group's timeout."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self._header = torch.zeros(2, dtype=torch.int64)
        self.last_sent_s = time.monotonic()

    def keep_alive(self) -> None:
        """Rank 0 with nothing to run: tell the followers it is alive, at most every ``KEEPALIVE_INTERVAL_S``."""
        if time.monotonic() - self.last_sent_s >= KEEPALIVE_INTERVAL_S:
            self.send(StepMessage(StepKind.KEEPALIVE))

    def stop(self) -> None:
        """Rank 0 is done: the followers' ``serve`` returns."""
        if not self.group.broken:
            self.send(StepMessage(StepKind.STOP))

    def send(self, message: StepMessage) -> None:
        self.last_sent_s = time.monotonic()
        payload = message.encode()
        self._header[0], self._header[1] = int(message.kind), payload.numel()
        self.group.broadcast(self._header)
        if payload.numel():
            self.group.broadcast(payload)

    def control(self, message: bytes, reply: bool = False, kind: StepKind = StepKind.CONTROL) -> list[bytes]:
        """A control message of the worker's KV endpoints (CONTROL: ``TPFollower``'s ``kv.control``) or of its KV
        tiers (TIERS: ``tiers.control``) to every follower; with ``reply``, each follower's answer, in rank order
        (rank 0's own is b"")."""
        self.send(StepMessage(kind, control=message, reply=reply))
        return self.group.gather_bytes(b"") if reply else []

    def receive(self) -> StepMessage:
        self.group.broadcast(self._header)
        kind, length = StepKind(int(self._header[0])), int(self._header[1])
        payload = torch.zeros(length, dtype=torch.int64)
        if length:
            self.group.broadcast(payload)
        return StepMessage.decode(kind, payload)


class FollowerKV(Protocol):
    """A follower rank's KV endpoints, as the worker builds them (worker/rank_kv.py): what its control messages do
    (an answer for rank 0, b"" when none is asked), and its heads of a step's exported blocks, after each layer."""

    def control(self, message: bytes) -> bytes: ...

    def export(self, layer: int, spans: list[ExportSpan], k: torch.Tensor, v: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class FollowerTiers(Protocol):
    """A follower rank's KV tiers (engine.rank_tiers): what rank 0's TIERS messages do (an answer, b"" when none is
    asked)."""

    def control(self, message: bytes) -> bytes: ...

    def close(self) -> None: ...


class FollowerRunner(Protocol):
    """What a follower drives: its rank's ``engine.model_runner.ModelRunner``."""

    layer_hook: LayerHook | None
    kv_cache: KVCache
    head_split: HeadSplit | None

    def execute(self, chunks: list[ScheduledChunk]) -> object: ...


class TPFollower:
    """A rank other than 0: runs every step rank 0 announces on its own shard, until the stop or a failure; after
    each layer of a step that exports KV, hands its heads of those blocks to its KV endpoints (``kv``), which send
    them; passes the worker's control messages to them, and rank 0's tier messages to its KV tiers (``tiers``,
    closed when serving ends)."""

    def __init__(
        self,
        runner: FollowerRunner,
        channel: StepChannel,
        kv: FollowerKV | None = None,
        tiers: FollowerTiers | None = None,
    ) -> None:
        self.runner = runner
        self.channel = channel
        self.kv = kv
        self.tiers = tiers
        self.steps = 0

    def serve(self) -> str:
        """Returns why it ended: "stop", or the group's failure (rank 0 gone, a timeout)."""
        try:
            return self._serve()
        finally:
            if self.tiers is not None:
                self.tiers.close()

    def _serve(self) -> str:
        while True:
            try:
                message = self.channel.receive()
                if message.kind == StepKind.STOP:
                    return "stop"
                if message.kind == StepKind.STEP:
                    self.runner.layer_hook = self._export_hook(message.exports)
                    self.runner.execute(message.chunks)
                    self.steps += 1
                elif message.kind in BYTE_KINDS:
                    endpoint = self.kv if message.kind == StepKind.CONTROL else self.tiers
                    answer = endpoint.control(message.control) if endpoint is not None else b""
                    if message.reply:
                        self.channel.group.gather_bytes(answer)
            except TPError as exc:
                logger.error("tensor-parallel rank %d stops: %s", self.channel.group.rank, exc)
                return str(exc)

    def _export_hook(self, spans: list[ExportSpan]) -> LayerHook | None:
        kv = self.kv
        if not spans or kv is None:
            return None
        cache = self.runner.kv_cache
        index = cache.block_index([block for span in spans for block in span.block_ids])

        def send_heads(layer: int, _batch: object) -> None:
            k, v = cache.read_blocks(layer, index)
            kv.export(layer, spans, k, v)

        return send_heads
