"""Wire format: strict header decoding, piece checks, frame checks, int8 error bound."""

from __future__ import annotations

import msgpack
import msgspec
import pytest
import torch

from tests.helpers.kv import fingerprint, make_kv
from transfer.compress import dequantize_int8, quantize_int8
from transfer.errors import ChecksumError, FingerprintMismatch, FrameTooLarge, ProtocolError
from transfer.wire import (
    MAX_HEADER_BYTES,
    Hello,
    ModelFingerprint,
    Nack,
    PieceHeader,
    Welcome,
    check_piece,
    decode_frames,
    encode_piece,
    frame_bytes,
    frame_view,
    pack_header,
    unpack_header,
    verify_tensors,
)

pytestmark = pytest.mark.timeout(30)


def _piece(fp: ModelFingerprint, wire: str = "raw", n: int = 3):
    k, v = make_kv(fp, 1, n, seed=7)
    return encode_piece(fp, "t", 1, list(range(n)), k, v, wire, with_checksum=True)


def test_header_round_trip_and_strictness() -> None:
    fp = fingerprint()
    piece, _ = _piece(fp)
    h = unpack_header(pack_header(piece))
    assert h == piece
    with pytest.raises(ProtocolError, match="version"):
        unpack_header(msgpack.packb({"v": 99, "kind": "kv"}))
    with pytest.raises(ProtocolError, match="kind"):
        unpack_header(pack_header({"kind": "exec"}))
    with pytest.raises(ProtocolError):
        unpack_header(b"\xc1garbage")
    with pytest.raises(ProtocolError, match="map"):
        unpack_header(msgpack.packb([1, 2]))
    with pytest.raises(ProtocolError):  # non-str map keys are refused (strict_map_key)
        unpack_header(msgpack.packb({1: 2}))
    with pytest.raises(FrameTooLarge):
        unpack_header(b"\x00" * (MAX_HEADER_BYTES + 1))
    bad = dict(msgspec.to_builtins(piece), layer=-1)
    with pytest.raises(ProtocolError, match="layer"):
        unpack_header(pack_header(bad))


@pytest.mark.parametrize("blocks", [[], [0, -1, 2], [0, True, 2], [0, 1.0, 2], [0, "1", 2], [0, None]])
def test_block_ids_must_be_non_negative_ints(blocks) -> None:
    h = msgspec.to_builtins(_piece(fingerprint())[0])
    with pytest.raises(ProtocolError, match="blocks"):
        unpack_header(pack_header(dict(h, blocks=blocks)))
    assert unpack_header(pack_header(dict(h, blocks=[0, 2**40, 5]))).blocks == (0, 2**40, 5)


def test_check_piece_sizes_fingerprint_and_bound() -> None:
    fp = fingerprint("float16")
    piece, _ = _piece(fp)
    check_piece(piece, fp, 1 << 20)
    other = ModelFingerprint(fp.architecture, fp.dtype, fp.num_layers, fp.num_kv_heads, 16, fp.block_size)
    with pytest.raises(FingerprintMismatch):
        check_piece(piece, other, 1 << 20)
    with pytest.raises(FrameTooLarge):
        check_piece(piece, fp, 100)
    lying = PieceHeader(
        piece.transfer_id, piece.layer, piece.blocks + (9,), piece.wire, piece.frames, piece.fingerprint
    )
    with pytest.raises(ProtocolError, match="expected"):
        check_piece(lying, fp, 1 << 20)


def test_decode_frames_truncated_and_corrupted() -> None:
    fp = fingerprint("bfloat16")
    piece, tensors = _piece(fp)
    bufs = [bytes(frame_view(t)) for t in tensors]
    k, v = decode_frames(piece, bufs)
    assert torch.equal(k.view(torch.int16), tensors[0].view(torch.int16))
    with pytest.raises(ProtocolError, match="truncated"):
        decode_frames(piece, [bufs[0][:-2], bufs[1]])
    with pytest.raises(ProtocolError, match="frames"):
        decode_frames(piece, bufs[:1])
    flipped = bytearray(bufs[1])
    flipped[5] ^= 0x10
    with pytest.raises(ChecksumError):
        decode_frames(piece, [bufs[0], bytes(flipped)])


def test_tensors_received_directly_are_held_to_their_frames_before_the_checksum() -> None:
    """The local and NCCL paths hand payloads over as tensors: a short one, a reshaped one or a missing one is refused
    by its size, even without a checksum to catch it."""
    fp = fingerprint()
    piece, tensors = _piece(fp)
    assert verify_tensors(piece, tensors) == tensors
    unchecked = msgspec.structs.replace(piece, frames=[msgspec.structs.replace(f, xxh3=None) for f in piece.frames])
    with pytest.raises(ProtocolError, match="payload of"):
        verify_tensors(unchecked, [tensors[0].reshape(-1)[:-1], tensors[1]])
    with pytest.raises(ProtocolError, match="payload of"):
        verify_tensors(unchecked, [tensors[0].reshape(-1), tensors[1]])
    with pytest.raises(ProtocolError, match="frames"):
        verify_tensors(unchecked, tensors[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_frame_bytes_views_the_tensors_bytes(dtype: torch.dtype) -> None:
    """The copies' view of a frame: the same bytes as frame_view's, without a copy; a view it cannot give is refused."""
    t = torch.arange(24, dtype=torch.float32).to(dtype).view(2, 3, 4)
    got = frame_bytes(t)
    assert got.dtype.name == "uint8" and got.shape == (t.numel() * t.element_size(),)
    assert got.tobytes() == bytes(frame_view(t))
    got[0] ^= 0xFF  # a view: writing it writes the tensor
    assert bytes(frame_view(t))[0] == got[0]
    with pytest.raises(ValueError, match="contiguous CPU"):
        frame_bytes(t.transpose(0, 1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_int8_error_bound(dtype: str) -> None:
    fp = fingerprint(dtype, head_dim=64, block_size=16)
    k = torch.randn(5, *fp.block_shape).to(fp.torch_dtype)
    q, scale = quantize_int8(k)
    assert q.dtype == torch.int8 and scale.shape == (5, fp.num_kv_heads)
    back = dequantize_int8(q, scale, fp.torch_dtype)
    amax = k.float().abs().amax(dim=(1, 3), keepdim=True)
    err = (back.float() - k.float()).abs()
    # half a quantization step, plus the destination dtype's own rounding
    bound = amax / 127 * 0.5 + k.float().abs() * (2**-7 if dtype == "bfloat16" else 2**-10) + 1e-6
    assert bool((err.permute(0, 2, 1, 3) <= bound.permute(0, 2, 1, 3)).all())
    assert q.numel() * 1 + scale.numel() * 4 < k.numel() * k.element_size()


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "ack", "tid": "t", "exec": "rm -rf /"},  # a field no header has
        {"kind": "ack", "tid": "t" * 5000},  # past a string bound
        {"kind": "finish", "tid": "t", "pieces": -1},
        {"kind": "hello", "fp": ["L", "float32", 2, 2, 4, 4], "transport": "zmq", "nonce": b"short"},
        {"kind": "hello", "fp": ["L", "float64", 2, 2, 4, 4], "transport": "zmq", "nonce": b"n" * 16},
        {
            "kind": "welcome",
            "session": b"s" * 16,
            "nonce": b"n" * 16,
            "rnonce": b"r" * 16,
            "max_frame_bytes": 1,
            "store_port": 70000,
        },
    ],
)
def test_every_header_kind_is_a_struct_with_bounds(fields) -> None:
    """Each message kind decodes into its Struct or is refused as a ProtocolError: unknown fields, strings, byte
    strings, ports and counts out of bounds, a fingerprint with a dtype the protocol does not carry."""
    with pytest.raises(ProtocolError):
        unpack_header(pack_header(fields))


def test_control_headers_round_trip_and_know_their_kind() -> None:
    fp = fingerprint()
    for header in (
        Hello(fp, "shm", b"n" * 16, "node-1", None),
        Welcome(b"s" * 16, b"n" * 16, b"r" * 16, 1 << 20, shm=["pdserve-kv-1-" + "0" * 32, 1 << 16, b"t" * 16]),
        Nack("t", "checksum", "xxh3 mismatch"),
    ):
        back = unpack_header(pack_header(header))
        assert back == header and back.kind == {Hello: "hello", Welcome: "welcome", Nack: "nack"}[type(header)]
