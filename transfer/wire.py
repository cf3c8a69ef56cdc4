"""Wire format of the KV plane: one sealed msgpack header (a msgspec Struct per kind) plus raw payload frames.

    sender:   k, v (contiguous) --encode_piece--> PieceHeader + payload tensors; pack_header -> bytes,
              frame_view -> memoryview of each tensor (no copy)
    wire:     [header, frame 0, frame 1, ...] (frames travel inline, through a shm ring, or by a pair group)
    receiver: unpack_header (size bound, msgspec types and bounds, version) -> check_piece (fingerprint, shapes,
              byte sizes, frame bound, all re-derived from its own fingerprint) -> decode_frames (lengths, xxh3_64,
              torch.frombuffer view, int8 dequantize)
Nothing received is unpickled or eval'd: a header decodes into one of the Structs below or is refused, and payload
frames are only ever viewed as tensors of the dtype and shape the receiver expects. bfloat16 travels as its bits.
"""

from __future__ import annotations

import array
import math
import warnings
from collections.abc import Sequence
from typing import Annotated, Any, Literal, cast

import msgspec
import numpy as np
import torch
import xxhash

from transfer.errors import ChecksumError, FingerprintMismatch, FrameTooLarge, ProtocolError

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 256 * 1024  # ~8k block ids fit; a larger header is refused before it is decoded
MAX_DIMS = 8

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int8: np.int8, torch.uint8: np.uint8}
_NAMES = {dt: name for name, dt in _DTYPES.items()}
KV_DTYPES = frozenset({"float32", "bfloat16", "float16", "uint8"})  # uint8: a quantized cache's rows, as bytes
KV_FORMATS = frozenset({"plain", "int8", "fp8_e4m3"})
KV_LAYOUTS = frozenset({"heads", "latent"})

Count = Annotated[int, msgspec.Meta(ge=0)]  # a shape entry, byte count, block id, position: never a bool or float
Text = Annotated[str, msgspec.Meta(max_length=4096)]
Wire = Literal["raw", "int8"]
Token = Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]  # session tokens and nonces


def dtype_name(dtype: torch.dtype) -> str:
    """Stable wire name of a torch dtype ("bfloat16"), refusing dtypes the protocol does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported on the wire") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r}") from None


class ModelFingerprint(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """What both sides must agree on before KV bytes of one can be written into the other's cache."""

    architecture: Annotated[str, msgspec.Meta(max_length=256)]
    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # how the stored rows read: "plain" values, or 8-bit values and a scale each (the engine's kv_cache_dtype)
    kv_format: Annotated[str, msgspec.Meta(max_length=16)] = "plain"
    # what a row is: one head's K or V ("heads"), or half of a latent-attention row ("latent")
    kv_layout: Annotated[str, msgspec.Meta(max_length=16)] = "heads"
    # the KV heads this end holds (a tensor-parallel rank's slice): heads [head_start, head_start + num_kv_heads) of
    # the model's ``model_kv_heads`` (0: all of them, num_kv_heads)
    head_start: int = 0
    model_kv_heads: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype {self.dtype!r} not in {sorted(KV_DTYPES)}")
        if self.kv_format not in KV_FORMATS:
            raise ValueError(f"KV format {self.kv_format!r} not in {sorted(KV_FORMATS)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"KV layout {self.kv_layout!r} not in {sorted(KV_LAYOUTS)}")
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"{f} must be > 0")
        if self.head_start < 0 or self.model_kv_heads < 0 or self.head_start + self.num_kv_heads > self.total_heads:
            raise ValueError(f"heads [{self.head_start}, +{self.num_kv_heads}) are not within {self.total_heads}")

    @classmethod
    def from_spec(cls, spec: Any) -> ModelFingerprint:
        """Build from the engine's `kv_spec` (duck-typed: transfer does not import engine)."""
        dt = spec.dtype if isinstance(spec.dtype, str) else dtype_name(spec.dtype)
        return cls(
            str(spec.architecture),
            dt,
            int(spec.num_layers),
            int(spec.num_kv_heads),
            int(spec.head_dim),
            int(spec.block_size),
            str(getattr(spec, "quantization", None) or "plain"),
            str(getattr(spec, "kv_layout", "heads")),
        )

    @property
    def total_heads(self) -> int:
        return self.model_kv_heads or self.num_kv_heads

    def slice(self, head_start: int, num_heads: int) -> ModelFingerprint:
        """The fingerprint of an end that holds heads ``[head_start, head_start + num_heads)`` of this one's (a
        tensor-parallel rank of a worker whose whole-model fingerprint this is)."""
        if self.head_start or self.model_kv_heads:
            raise ValueError("a slice is taken of the whole model's fingerprint")
        if (head_start, num_heads) == (0, self.num_kv_heads):
            return self
        return msgspec.structs.replace(
            self, num_kv_heads=num_heads, head_start=head_start, model_kv_heads=self.num_kv_heads
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)


class FrameSpec(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Declared layout of one payload frame: the receiver trusts none of it before `check_piece`."""

    dtype: Annotated[str, msgspec.Meta(max_length=16)]
    shape: Annotated[tuple[Count, ...], msgspec.Meta(max_length=MAX_DIMS)]
    nbytes: Count
    xxh3: int | None  # None: not checksummed (device tensors on NCCL)


class Header(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    v: Annotated[int, msgspec.Meta(ge=PROTOCOL_VERSION, le=PROTOCOL_VERSION)] = PROTOCOL_VERSION

    @property
    def kind(self) -> str:
        return str(self.__struct_config__.tag)


class Hello(Header, tag="hello"):  # S->R, sealed under the handshake key
    fp: ModelFingerprint
    transport: Annotated[str, msgspec.Meta(max_length=16)]  # "zmq", "shm" or "dist"
    nonce: Token
    node: Text | None = None  # transfer/shm_ring.py node_id: a ring is offered to a sender on the same node
    gpu: Text | None = None  # dist: this end's GPU UUID
    pidns: Text | None = None  # transfer/kv_segment.py pid_namespace: a receiver's cache is offered to a sender in it
    # with direct writes: the UUIDs of the GPUs this sender can open memory on (a GPU cache's must be among them)
    gpus: Annotated[list[Text], msgspec.Meta(max_length=64)] | None = None


class Welcome(Header, tag="welcome"):  # R->S, under the handshake key; names the session's payload path
    session: Token
    nonce: Token  # the hello's, echoed
    rnonce: Token
    max_frame_bytes: Count
    shm: Annotated[list[Any], msgspec.Meta(max_length=3)] | None = None  # a ring: [name, size, token]
    store_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None  # dist: the pair group's store
    same_gpu: bool = False
    gpu: Text | None = None
    # its KV cache: [pid, fd, token, blocks], and on a GPU [gpu, CUDA IPC handles] (transfer/kv_segment.py)
    direct: Annotated[list[Any], msgspec.Meta(max_length=5)] | None = None


class Reject(Header, tag="reject"):  # R->S, under the handshake key
    code: Text
    reason: Text


class PieceHeader(Header, tag="kv"):
    """K and V of `blocks` (destination ids) for one layer of one transfer."""

    transfer_id: Text = msgspec.field(name="tid")
    layer: Count
    blocks: Annotated[tuple[Count, ...], msgspec.Meta(min_length=1, max_length=65536)]
    wire: Wire
    frames: Annotated[tuple[FrameSpec, ...], msgspec.Meta(max_length=4)]
    fingerprint: ModelFingerprint = msgspec.field(name="fp")
    tags: Annotated[tuple[Count, ...], msgspec.Meta(max_length=4)] | None = None  # pair path: a p2p tag per frame
    shm: Annotated[list[Any], msgspec.Meta(max_length=5)] | None = None  # ring path: [positions..., end], checked by
    # shm_ring.check_positions against the ring itself
    direct: bool = False  # direct path: no payload, the sender wrote it into `blocks`; the frames' xxh3 cover them
    # some of the receiver's heads only, [first, first + count) of its slice (a tensor-parallel sender holds those);
    # None: all of them
    heads: tuple[Count, Count] | None = None

    @property
    def num_heads(self) -> int | None:
        return None if self.heads is None else self.heads[1]


MAX_BATCH_PIECES = 32  # a whole small transfer of a 30-layer model in one message


class Pieces(Header, tag="kvs"):
    """Several small pieces in one message, their frames in one payload frame (laid out by `batch_layout`; direct
    pieces have none): the per-message cost (seal, MAC, decode, socket calls) paid once for pieces ready together."""

    pieces: Annotated[tuple[PieceHeader, ...], msgspec.Meta(min_length=1, max_length=MAX_BATCH_PIECES)]


class Finish(Header, tag="finish"):
    tid: Text
    pieces: Count


class Abort(Header, tag="abort"):
    tid: Text
    reason: Text


class Ack(Header, tag="ack"):
    tid: Text


class Nack(Header, tag="nack"):
    tid: Text
    code: Text
    reason: Text


class Renew(Header, tag="renew"):  # either way: "still here" for one transfer's lease
    tid: Text


AnyHeader = Hello | Welcome | Reject | PieceHeader | Pieces | Finish | Abort | Ack | Nack | Renew
_DECODER = msgspec.msgpack.Decoder(AnyHeader)
_ENCODER = msgspec.msgpack.Encoder()


class Named(msgspec.Struct):
    """What a refused header names, read leniently: its transfer is failed, a ring region it used is released."""

    kind: Any = None
    tid: Any = None
    shm: Any = None


def pack_header(header: Header | dict[str, Any]) -> bytes:
    """A header's bytes (a plain dict gets the protocol version stamped; tests use it to send what no Struct would)."""
    if isinstance(header, dict):
        return _ENCODER.encode({"v": PROTOCOL_VERSION, **header})
    return _ENCODER.encode(header)


def unpack_header(data: bytes | memoryview) -> AnyHeader:
    """Strictly decode a header: size bound, then the Struct of its kind with every type and bound checked."""
    if len(data) > MAX_HEADER_BYTES:
        raise FrameTooLarge(f"header of {len(data)} bytes > {MAX_HEADER_BYTES}")
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as e:
        if "`$.v`" in str(e):
            raise ProtocolError(f"unsupported protocol version (want {PROTOCOL_VERSION}): {e}") from None
        raise ProtocolError(f"malformed header (not a map of its kind's fields): {e}") from None
    except msgspec.DecodeError as e:
        raise ProtocolError(f"undecodable header: {e}") from None


def named(data: bytes | memoryview) -> Named:
    try:
        return msgspec.msgpack.decode(data, type=Named)
    except msgspec.MsgspecError:
        return Named()


def frame_view(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if t.dtype in _NUMPY_DTYPES and t.device.type == "cpu" and t.is_contiguous():
        return t.numpy().data  # one torch call: this runs per frame
    return frame_bytes(t).data  # bfloat16 (numpy has no such dtype), or frame_bytes' refusal


def frame_bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat uint8 array, for copies (half the cost of numpy over frame_view's
    memoryview: this runs per frame of a batch or a direct write)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("a frame must be a contiguous CPU tensor")
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy().reshape(-1).view(np.uint8)
    return t.view(torch.uint8).numpy().reshape(-1)  # bfloat16: numpy has no such dtype


def checksum(buf: Any) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def spec_of(t: torch.Tensor, with_checksum: bool) -> FrameSpec:
    nbytes = t.numel() * t.element_size()
    xx = checksum(frame_view(t)) if with_checksum and t.device.type == "cpu" else None
    return FrameSpec(dtype_name(t.dtype), tuple(t.shape), nbytes, xx)


def with_checksums(p: PieceHeader, bufs: Sequence[Any]) -> PieceHeader:
    """The header with each frame's xxh3 taken over `bufs` (the bytes as they will be read: a sender that checksums
    late, over its copy in a shared-memory ring while that copy is still in cache, instead of over the source)."""
    return with_digests(p, [checksum(buf) for buf in bufs])


def with_digests(p: PieceHeader, digests: Sequence[int]) -> PieceHeader:
    """The header with each frame's xxh3 set to the given digests (taken by whoever wrote the bytes)."""
    frames = tuple(msgspec.structs.replace(f, xxh3=d) for f, d in zip(p.frames, digests, strict=True))
    return msgspec.structs.replace(p, frames=frames)


# Read-only buffers give read-only tensors by contract (tensor_over): the sink must copy out, and it writes into the
# KV cache anyway. The filter is set once: a catch_warnings per frame costs more than the rest of its decoding.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


def tensor_over(buf: Any, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing `buf` without copying (read-only if `buf` is); through numpy where it knows the dtype (one
    torch call per frame instead of three)."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is not None:
        return torch.from_numpy(np.frombuffer(buf, dtype=np_dtype).reshape(shape))
    return torch.frombuffer(buf, dtype=dtype).view(tuple(shape))


def expected_frames(
    fp: ModelFingerprint, wire: str, n: int, num_heads: int | None = None
) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every frame a piece of `n` blocks (of `num_heads` of our heads: all by default) must carry,
    derived from *our* fingerprint."""
    heads = fp.num_kv_heads if num_heads is None else num_heads
    full = (n, fp.block_size, heads, fp.head_dim)
    if wire == "raw":
        return [(fp.dtype, full), (fp.dtype, full)]
    if wire == "int8":
        scale = (n, heads)
        return [("int8", full), ("float32", scale), ("int8", full), ("float32", scale)]
    raise ProtocolError(f"unknown wire dtype {wire!r:.20}")


def batch_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each frame of a batch lies in its one payload frame (64-byte aligned, in order), and the total length."""
    offsets, at = [], 0
    for n in sizes:
        at = -(-at // 64) * 64
        offsets.append(at)
        at += n
    return offsets, at


def declared_sizes_match(p: PieceHeader, fp: ModelFingerprint) -> bool:
    """Whether a piece's frame sizes are those our fingerprint gives for its blocks: what makes a batch's layout
    (batch_layout over the declared sizes) trustworthy before any piece is checked in full."""
    if p.heads is not None and not (p.heads[1] > 0 and p.heads[0] + p.heads[1] <= fp.num_kv_heads):
        return False
    want = expected_frames(fp, p.wire, len(p.blocks), p.num_heads)
    return len(want) == len(p.frames) and all(
        f.nbytes == math.prod(shape) * dtype_from_name(dt).itemsize for f, (dt, shape) in zip(p.frames, want)
    )


def check_piece(p: PieceHeader, fp: ModelFingerprint, max_frame_bytes: int) -> None:
    """Everything that can be checked before touching payload bytes."""
    if p.fingerprint != fp:
        raise FingerprintMismatch(f"piece fingerprint {p.fingerprint} != receiver's {fp}")
    if not 0 <= p.layer < fp.num_layers:
        raise ProtocolError(f"layer {p.layer} out of range [0, {fp.num_layers})")
    if p.heads is not None and not (p.heads[1] > 0 and p.heads[0] + p.heads[1] <= fp.num_kv_heads):
        raise ProtocolError(f"heads {list(p.heads)} are not within the receiver's {fp.num_kv_heads}")
    want = expected_frames(fp, p.wire, len(p.blocks), p.num_heads)
    if len(p.frames) != len(want):
        raise ProtocolError(f"{len(p.frames)} frames, expected {len(want)} for wire={p.wire}")
    for spec, (dt, shape) in zip(p.frames, want):
        if spec.nbytes <= max_frame_bytes and (spec.dtype != dt or spec.shape != shape):
            raise ProtocolError(f"frame {spec.dtype}{list(spec.shape)} != expected {dt}{list(shape)}")
        frame_nbytes(spec, max_frame_bytes)  # the bound first, then nbytes against the shape


def frame_nbytes(spec: FrameSpec, max_frame_bytes: int) -> int:
    """A frame's size, once its dtype is known, nbytes equals shape x itemsize and is within the bound: the only
    way a header field may size an allocation (the scratch receive of a refused piece on the nccl backend)."""
    if spec.nbytes > max_frame_bytes:
        raise FrameTooLarge(f"frame of {spec.nbytes} bytes > max_frame_bytes={max_frame_bytes}")
    if spec.nbytes != math.prod(spec.shape) * dtype_from_name(spec.dtype).itemsize:
        raise ProtocolError(f"frame nbytes {spec.nbytes} does not match {spec.dtype}{list(spec.shape)}")
    return spec.nbytes


def decode_frames(p: PieceHeader, bufs: Sequence[Any]) -> list[torch.Tensor]:
    """Length- and checksum-check each received buffer, then view it as its tensor (no copy)."""
    if len(bufs) != len(p.frames):
        raise ProtocolError(f"message has {len(bufs)} payload frames, header declares {len(p.frames)}")
    out = []
    for spec, buf in zip(p.frames, bufs):
        mv = memoryview(buf)
        if mv.nbytes != spec.nbytes:
            raise ProtocolError(f"frame truncated or padded: {mv.nbytes} bytes, header says {spec.nbytes}")
        if spec.xxh3 is not None and checksum(mv) != spec.xxh3:
            raise ChecksumError(f"xxh3 mismatch on a {spec.nbytes}-byte frame of layer {p.layer}")
        out.append(tensor_over(mv, dtype_from_name(spec.dtype), spec.shape))
    return out


def verify_tensors(p: PieceHeader, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Checksum-check payloads received directly into tensors (CPU ones; device ones carry none), each first held to
    its frame's declared size and shape (a short one is refused before anything reads it)."""
    if len(tensors) != len(p.frames):
        raise ProtocolError(f"layer {p.layer}: {len(tensors)} payload tensors for {len(p.frames)} frames")
    for spec, t in zip(p.frames, tensors, strict=True):
        if t.numel() * t.element_size() != spec.nbytes or tuple(t.shape) != tuple(spec.shape):
            raise ProtocolError(
                f"layer {p.layer}: a payload of {t.numel() * t.element_size()} bytes {tuple(t.shape)} for a frame of "
                f"{spec.nbytes} bytes {tuple(spec.shape)}"
            )
        if spec.xxh3 is not None and t.device.type == "cpu" and checksum(frame_view(t)) != spec.xxh3:
            raise ChecksumError(f"xxh3 mismatch on a {spec.nbytes}-byte frame of layer {p.layer}")
    return list(tensors)


def encode_piece(
    fp: ModelFingerprint,
    transfer_id: str,
    layer: int,
    blocks: Sequence[int],
    k: torch.Tensor,
    v: torch.Tensor,
    wire: str,
    with_checksum: bool,
    heads: tuple[int, int] | None = None,
) -> tuple[PieceHeader, list[torch.Tensor]]:
    """Header and payload tensors (contiguous, in frame order) for one layer piece (``heads``: of some of the
    receiver's heads only).

    raw: [k, v] as they are (bit-exact). int8: [k_q, k_scale, v_q, v_scale] (see transfer.compress)."""
    from transfer.compress import quantize_int8

    if wire == "int8":
        tensors = [*quantize_int8(k), *quantize_int8(v)]
    elif wire == "raw":
        tensors = [k.contiguous(), v.contiguous()]
    else:
        raise ValueError(f"unknown wire dtype {wire!r}")
    specs = tuple(spec_of(t, with_checksum) for t in tensors)
    header = PieceHeader(transfer_id, layer, block_tuple(blocks), cast(Wire, wire), specs, fp, heads=heads)
    return header, tensors


def block_tuple(blocks: Sequence[int]) -> tuple[int, ...]:
    """Block ids as plain ints (numpy's would not encode), through a C loop: ``tuple(map(int, ...))`` took 7 µs per
    piece of 182 blocks, this 3."""
    return tuple(array.array("q", blocks).tolist())
