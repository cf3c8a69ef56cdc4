"""`pdserve bench transfer` on the shm backend, small: every row carries its own memcpy reference (timed rep by rep
with the transfers), its ratio to it and the CPU time of each side; the transfers are checked DONE by the bench."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from bench import ring_ceiling, transfer_bench

pytestmark = pytest.mark.timeout(120)


def test_shm_rows_carry_an_interleaved_memcpy_reference_and_cpu_times() -> None:
    ap = argparse.ArgumentParser()
    transfer_bench.add_arguments(ap)
    out = transfer_bench.run(ap.parse_args(["--backends", "shm", "--sizes-mib", "0.5", "--reps", "2"]))
    json.dumps(out)  # what the command prints
    row, ceiling = out["results"]
    assert row["backend"] == "shm" and row["bytes"] == transfer_bench._blocks(0.5) * transfer_bench.BLOCK_BYTES
    # the bare two-copy ring of the same bytes, measured in the same run, and how much of it shm reached
    assert ceiling["backend"] == "ring-ceiling" and ceiling["bytes"] == row["bytes"] and ceiling["gbps"] > 0
    assert row["ratio_vs_ceiling"] == pytest.approx(row["gbps"] / ceiling["gbps"], rel=0.05, abs=2e-3)
    assert row["gbps"] > 0 and row["memcpy_gbps"] > 0
    assert row["ratio_vs_memcpy"] == pytest.approx(row["gbps"] / row["memcpy_gbps"], rel=0.05, abs=2e-3)
    assert row["cpu_ms"]["sender"] > 0 and row["cpu_ms"]["receiver"] > 0
    assert out["memcpy_gbps"]["0.5"] > 0 and out["checksum"] is True


def test_the_sink_copy_lands_the_bytes() -> None:
    cache = transfer_bench._Cache(3)
    k, v = transfer_bench._kv(3)[0]
    cache.sink("t", 0, [0, 1, 2], k, v)
    assert cache.k[0].equal(k) and cache.v[0].equal(v)


def test_the_ring_ceiling_moves_every_byte_and_ends_its_sender() -> None:
    """The bare ring the shm row is compared with really moves the bytes (the destination equals the sender's
    payload), its ratio is its own figures', and no shared memory is left behind."""
    before = set(os.listdir("/dev/shm"))
    row = ring_ceiling.measure(3 << 20, 100_000, reps=2, ring_bytes=1 << 20)  # frames wrap the ring many times
    assert row["intact"] and row["gbps"] > 0 and row["memcpy_gbps"] > 0
    assert row["ratio_vs_memcpy"] == pytest.approx(row["gbps"] / row["memcpy_gbps"], rel=0.05, abs=2e-3)
    assert set(os.listdir("/dev/shm")) <= before


def test_zmq_rows_carry_the_raw_sockets_cpu_per_transfer() -> None:
    """The fixed cost per transfer explains itself: the same bytes as bare ZeroMQ messages, timed each side."""
    ap = argparse.ArgumentParser()
    transfer_bench.add_arguments(ap)
    out = transfer_bench.run(ap.parse_args(["--backends", "zmq-tcp", "--sizes-mib", "0.5", "--reps", "2"]))
    (row,) = out["results"]
    assert row["ratio_vs_raw_zmq"] == pytest.approx(row["gbps"] / out["raw_zmq_gbps"]["zmq-tcp"]["0.5"], rel=0.05)
    assert row["raw_zmq_cpu_ms"]["sender"] > 0 and row["raw_zmq_cpu_ms"]["receiver"] > 0
