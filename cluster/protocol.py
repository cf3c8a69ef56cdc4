"""Control-plane messages between the router and the workers: msgpack maps over ZeroMQ, never pickle.

Router -> worker (each worker's PULL socket):
    reserve  {rid, prompt, params}                      decode: reserve KV blocks, expect the transfer
    prefill  {rid, prompt, params, kv_address, dst_blocks}   prefill: compute, stream KV, sample the first token
    start    {rid, first_token}                         decode: the first token (KV may still be arriving)
    generate {rid, prompt, params}                      colocated: both phases here
    abort    {rid}                                      any: free whatever the request holds
Worker -> router (the router's PULL socket):
    reserved    {rid, worker, ok, blocks, kv_address, reason}
    first_token {rid, worker, token, timing}
    tokens      {worker, items: [[rid, [token ids], finish_reason | None, timing | None], ...]}  one per step
    error       {rid, worker, message, code}
    stats       {worker, role, ...load and counters}    a heartbeat, several times a second
Sizes are bounded on unpack, map keys must be strings, and only plain types (ints, floats, strings, lists, maps)
can appear, so a message cannot make the receiver run anything.
"""

from __future__ import annotations

from dataclasses import asdict

import msgpack

from engine.request import SamplingParams

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class ProtocolError(ValueError):
    pass


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise ProtocolError(f"undecodable control message: {exc}") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise ProtocolError("control message must be a map with a string 'type'")
    return message


def params_to_wire(params: SamplingParams) -> dict:
    return asdict(params)


def params_from_wire(data: dict) -> SamplingParams:
    fields = SamplingParams.__dataclass_fields__
    unknown = set(data) - set(fields)
    if unknown:
        raise ProtocolError(f"unknown sampling fields {sorted(unknown)}")
    params = SamplingParams(**data)
    params.validate()
    return params
