"""Wire format of KV transfers: one msgpack header plus raw payload frames per message.

Data flow for one *layer piece* (K and V of `n` blocks of one layer of one transfer):

    sender:   k, v (contiguous CPU tensors)  --encode_piece-->  header dict + payload tensors
              header -> pack_header -> bytes;  tensors -> frame_view -> memoryview (no copy)
    wire:     [header bytes, frame 0, frame 1, ...]
    receiver: unpack_header (strict msgpack limits, version check) -> PieceHeader.from_wire (types)
              -> check_piece (fingerprint, shapes, byte sizes, frame bound)
              -> decode_piece (frame lengths, xxh3_64, torch.frombuffer view, int8 dequantize)

Nothing received is unpickled or eval'd: headers are msgpack maps of str/int/bytes/lists only, payload
frames are bytes that are only ever viewed as tensors of the dtype and shape the header declared and the
receiver re-derived from its own model fingerprint. bfloat16 travels as its 16-bit pattern (bytes).

Control messages (hello/welcome/reject/finish/abort/ack/nack/renew) are header-only maps; their fields
are documented in docs/transfer.md.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack
import torch
import xxhash

from transfer.errors import ChecksumError, FingerprintMismatch, FrameTooLarge, ProtocolError

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 256 * 1024
"""Bound on a header's size: ~8k block ids fit; anything larger is refused before msgpack sees it."""

KINDS = frozenset({"hello", "welcome", "reject", "kv", "finish", "abort", "ack", "nack", "renew"})

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
}
KV_DTYPES = frozenset({"float32", "bfloat16", "float16"})
WIRE_DTYPES = frozenset({"raw", "int8"})


def dtype_name(dtype: torch.dtype) -> str:
    """Stable wire name of a torch dtype ("bfloat16"), refusing dtypes the protocol does not carry."""
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype} is not supported on the wire")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ProtocolError(f"unknown dtype {name!r}") from None


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What both sides must agree on before KV bytes of one can be written into the other's cache."""

    architecture: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype {self.dtype!r} not in {sorted(KV_DTYPES)}")
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if int(getattr(self, f)) <= 0:
                raise ValueError(f"{f} must be > 0")

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
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def to_wire(self) -> list[Any]:
        return [self.architecture, self.dtype, self.num_layers, self.num_kv_heads, self.head_dim, self.block_size]

    @classmethod
    def from_wire(cls, obj: Any) -> ModelFingerprint:
        if not (
            isinstance(obj, list)
            and len(obj) == 6
            and isinstance(obj[0], str)
            and isinstance(obj[1], str)
            and all(isinstance(x, int) for x in obj[2:])
        ):
            raise ProtocolError(f"malformed fingerprint {obj!r:.200}")
        try:
            return cls(*obj)
        except ValueError as e:
            raise ProtocolError(f"invalid fingerprint: {e}") from None


# ---------------------------------------------------------------------------------------- headers


def pack_header(fields: dict[str, Any]) -> bytes:
    """Serialize a header; always stamps the protocol version."""
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def unpack_header(data: bytes | memoryview) -> dict[str, Any]:
    """Strictly decode a header: size bound, msgpack limits, map type, version, known kind."""
    if len(data) > MAX_HEADER_BYTES:
        raise FrameTooLarge(f"header of {len(data)} bytes > {MAX_HEADER_BYTES}")
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=4096,
            max_bin_len=4096,
            max_array_len=65536,
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises several types (ExtraData, ValueError, FormatError, ...)
        raise ProtocolError(f"undecodable header: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("header is not a map")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {obj.get('v')!r} (want {PROTOCOL_VERSION})")
    if obj.get("kind") not in KINDS:
        raise ProtocolError(f"unknown message kind {obj.get('kind')!r:.50}")
    return obj


def field(h: dict[str, Any], key: str, typ: type | tuple[type, ...]) -> Any:
    """Typed access to a header field; a missing or mistyped field is a ProtocolError."""
    val = h.get(key)
    if not isinstance(val, typ) or isinstance(val, bool) and typ is int:
        raise ProtocolError(f"header field {key!r} missing or not {typ}")
    return val


# ---------------------------------------------------------------------------------------- frames

MAX_DIMS = 8


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _count(x: Any) -> bool:
    """A non-negative int (not a bool): what a shape entry, a byte count or a block id must be."""
    return _int(x) and x >= 0


def _counts(xs: list[Any]) -> bool:
    """Every item a non-negative int, checked in C: a piece's block ids (hundreds per piece, 130 us per piece as a
    generator of _count calls on this loaded box, 7 us so; msgpack decodes exact ints, never subclasses)."""
    return set(map(type, xs)) == {int} and min(xs) >= 0


@dataclass(frozen=True, slots=True)
class FrameSpec:
    """Declared layout of one payload frame: the receiver trusts none of it before checking."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    xxh3: int | None  # None: not checksummed (device-resident tensors on the nccl backend)

    def to_wire(self) -> list[Any]:
        return [self.dtype, list(self.shape), self.nbytes, self.xxh3]

    @classmethod
    def from_wire(cls, obj: Any) -> FrameSpec:
        """Types and signs only; `check_piece` then compares shape and dtype with what the receiver expects and
        nbytes with shape x itemsize, before anything is allocated or viewed."""
        if not (
            isinstance(obj, list)
            and len(obj) == 4
            and isinstance(obj[0], str)
            and isinstance(obj[1], list)
            and len(obj[1]) <= MAX_DIMS
            and all(_count(x) for x in obj[1])
            and _count(obj[2])
            and (obj[3] is None or _int(obj[3]))
        ):
            raise ProtocolError(f"malformed frame spec {obj!r:.200}")
        return cls(obj[0], tuple(obj[1]), obj[2], obj[3])


def frame_view(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("frame_view needs a contiguous CPU tensor")
    return t.reshape(-1).view(torch.uint8).numpy().data


def checksum(buf: Any) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def spec_of(t: torch.Tensor, with_checksum: bool) -> FrameSpec:
    nbytes = t.numel() * t.element_size()
    xx = checksum(frame_view(t)) if with_checksum and t.device.type == "cpu" else None
    return FrameSpec(dtype_name(t.dtype), tuple(t.shape), nbytes, xx)


def with_checksums(p: PieceHeader, bufs: Sequence[Any]) -> PieceHeader:
    """The header with each frame's xxh3 taken over `bufs` (the bytes as they will be read: a sender that checksums
    late, over its copy in a shared-memory ring while that copy is still in cache, instead of over the source)."""
    frames = tuple(replace(spec, xxh3=checksum(buf)) for spec, buf in zip(p.frames, bufs, strict=True))
    return replace(p, frames=frames)


def tensor_over(buf: Any, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing `buf` without copying. Read-only buffers give read-only tensors by contract:
    the sink must copy out (it writes into the KV cache anyway), so torch's warning is silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).view(tuple(shape))


# ---------------------------------------------------------------------------------------- pieces


@dataclass(frozen=True, slots=True)
class PieceHeader:
    """A "kv" message: K and V of `blocks` (destination ids) for one layer of one transfer."""

    transfer_id: str
    layer: int
    blocks: tuple[int, ...]
    wire: str  # "raw" or "int8"
    frames: tuple[FrameSpec, ...]
    fingerprint: ModelFingerprint
    tags: tuple[int, ...] | None = None  # nccl/gloo backend: p2p tags carrying the frames

    def to_wire(self, session: bytes) -> dict[str, Any]:
        h: dict[str, Any] = {
            "kind": "kv",
            "session": session,
            "tid": self.transfer_id,
            "layers": [self.layer, self.layer + 1],
            "blocks": list(self.blocks),
            "wire": self.wire,
            "frames": [f.to_wire() for f in self.frames],
            "fp": self.fingerprint.to_wire(),
        }
        if self.tags is not None:
            h["tags"] = list(self.tags)
        return h

    @classmethod
    def from_wire(cls, h: dict[str, Any]) -> PieceHeader:
        layers = field(h, "layers", list)
        if len(layers) != 2 or not all(_count(x) for x in layers) or layers[1] != layers[0] + 1:
            raise ProtocolError(f"layer range {layers!r:.50} must be [l, l+1]")
        blocks = field(h, "blocks", list)
        if not blocks or not _counts(blocks):
            raise ProtocolError("blocks must be a non-empty list of non-negative ints")
        frames = tuple(FrameSpec.from_wire(f) for f in field(h, "frames", list))
        tags = h.get("tags")
        if tags is not None and not (
            isinstance(tags, list) and len(tags) == len(frames) and all(_count(t) for t in tags)
        ):
            raise ProtocolError("tags must be one int per frame")
        return cls(
            field(h, "tid", str),
            layers[0],
            tuple(blocks),
            field(h, "wire", str),
            frames,
            ModelFingerprint.from_wire(h.get("fp")),
            tuple(tags) if tags is not None else None,
        )


def expected_frames(fp: ModelFingerprint, wire: str, n: int) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every frame a piece of `n` blocks must carry, derived from *our* fingerprint."""
    full = (n, *fp.block_shape)
    if wire == "raw":
        return [(fp.dtype, full), (fp.dtype, full)]
    if wire == "int8":
        scale = (n, fp.num_kv_heads)
        return [("int8", full), ("float32", scale), ("int8", full), ("float32", scale)]
    raise ProtocolError(f"unknown wire dtype {wire!r:.20}")


def check_piece(p: PieceHeader, fp: ModelFingerprint, max_frame_bytes: int) -> None:
    """Everything that can be checked before touching payload bytes."""
    if p.fingerprint != fp:
        raise FingerprintMismatch(f"piece fingerprint {p.fingerprint} != receiver's {fp}")
    if not 0 <= p.layer < fp.num_layers:
        raise ProtocolError(f"layer {p.layer} out of range [0, {fp.num_layers})")
    want = expected_frames(fp, p.wire, len(p.blocks))
    if len(p.frames) != len(want):
        raise ProtocolError(f"{len(p.frames)} frames, expected {len(want)} for wire={p.wire}")
    for spec, (dt, shape) in zip(p.frames, want):
        if spec.nbytes > max_frame_bytes:
            raise FrameTooLarge(f"frame of {spec.nbytes} bytes > max_frame_bytes={max_frame_bytes}")
        if spec.dtype != dt or spec.shape != shape:
            raise ProtocolError(f"frame {spec.dtype}{list(spec.shape)} != expected {dt}{list(shape)}")
        if spec.nbytes != math.prod(shape) * dtype_from_name(dt).itemsize:
            raise ProtocolError(f"frame nbytes {spec.nbytes} does not match {dt}{list(shape)}")


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
    """Checksum-check payloads received directly into tensors (CPU ones; device ones carry none)."""
    for spec, t in zip(p.frames, tensors, strict=True):
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
) -> tuple[PieceHeader, list[torch.Tensor]]:
    """Header and payload tensors (contiguous, in frame order) for one layer piece.

    raw: [k, v] as they are (bit-exact). int8: [k_q, k_scale, v_q, v_scale] (see transfer.compress)."""
    from transfer.compress import quantize_int8

    if wire == "int8":
        tensors = [*quantize_int8(k), *quantize_int8(v)]
    elif wire == "raw":
        tensors = [k.contiguous(), v.contiguous()]
    else:
        raise ValueError(f"unknown wire dtype {wire!r}")
    specs = tuple(spec_of(t, with_checksum) for t in tensors)
    return PieceHeader(transfer_id, layer, tuple(map(int, blocks)), wire, specs, fp), tensors
