"""A hand-off's parts joined into one event (worker/rank_kv.py), in one process: a degree-1 sender into a degree-2
receiver over the in-process KV plane, whose rank 1 hears rank 0's control messages through a loopback channel
(the real step channel, over gloo between processes, is in test_rank_kv.py). Each hand-off ends exactly once, the
first failed part ends it and aborts the rest on every rank, an abort ends it at once; nothing is left pending."""

from __future__ import annotations

import time

import pytest
import torch

from engine.kv_cache import KVCache, KVSpec
from transfer.local_backend import LocalHub, LocalReceiver, LocalSender
from worker.handoff_join import HandoffReceiver, HandoffSender
from worker.rank_kv import HandoffLayout, RankKV

SPEC = KVSpec("llama", torch.float32, num_layers=2, num_kv_heads=2, head_dim=4, block_size=2)
HEADS = 4  # attention heads: one KV head per rank at degree 2


class LoopbackChannel:
    """Rank 0's control messages straight to the other ranks' ``control``, in order, answers gathered."""

    def __init__(self, followers: list[RankKV]) -> None:
        self.followers = followers

    def control(self, message: bytes, reply: bool = False) -> list[bytes]:
        answers = [follower.control(message) for follower in self.followers]
        return [b"", *answers] if reply else []


class Pair:
    def __init__(self) -> None:
        from transfer.wire import ModelFingerprint

        hub = LocalHub()
        whole = ModelFingerprint.from_spec(SPEC)
        self.caches = [KVCache(_rank_spec(), 16, "cpu") for _ in range(2)]
        self.ranks = [
            RankKV(
                HandoffLayout(whole, HEADS, 2, rank, 2),
                self.caches[rank],
                make_receiver=lambda fp, sink, rank=rank: LocalReceiver(fp, sink, f"local://d{rank}", hub=hub),
                land=self._lander(rank),
            )
            for rank in range(2)
        ]
        self.receiver = HandoffReceiver(self.ranks[0], LoopbackChannel(self.ranks[1:]))
        sender_kv = RankKV(HandoffLayout(whole, HEADS), make_sender=lambda fp: LocalSender(fp, hub=hub))
        self.sender = HandoffSender(sender_kv)
        self.source = torch.arange(2 * 3 * 2 * 2 * 4, dtype=torch.float32).reshape(2, 3, 2, 2, 4)  # [k/v, blocks..]

    def _lander(self, rank: int):
        def land(_handoff, layer, blocks, k, v, heads):
            self.caches[rank].write_blocks(layer, blocks, k, v, heads)

        return land

    def begin(self, rid: str, dst: list[int]) -> None:
        self.receiver.expect(rid, dst)
        self.sender.begin(rid, self.receiver.address, dst)

    def send_all(self, rid: str, dst: list[int]) -> bool:
        sent = [self.sender.send_layer(rid, layer, dst, self.source[0], self.source[1]) for layer in range(2)]
        self.sender.finish(rid)
        return all(sent)

    def events(self, until_s: float = 5.0) -> tuple[list, list]:
        """Every event of both sides until both are quiet (or ``until_s``)."""
        got_sent, got_received, deadline = [], [], time.monotonic() + until_s
        while time.monotonic() < deadline:
            received, sent = self.receiver.poll(), self.sender.poll()
            got_received += received
            got_sent += sent
            if not self.receiver.pending_transfers() and not self.sender.active_transfers() and not (received or sent):
                break
            time.sleep(0.003)  # past the followers' poll interval
        return got_sent, got_received

    def quiet(self) -> None:
        assert all(rank.pending() == 0 for rank in self.ranks) and self.sender.kv.pending() == 0

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        self.ranks[1].close()


def _rank_spec() -> KVSpec:
    return KVSpec("llama", torch.float32, num_layers=2, num_kv_heads=1, head_dim=4, block_size=2)


@pytest.fixture
def pair():
    made = Pair()
    yield made
    made.close()


def test_a_degree_one_sender_splits_its_heads_across_the_receiving_ranks(pair):
    dst = [3, 5, 7]
    pair.begin("r", dst)
    assert pair.send_all("r", dst)
    sent, received = pair.events()
    assert [(e.transfer_id, e.ok) for e in sent] == [("r", True)]
    assert [(e.transfer_id, e.ok) for e in received] == [("r", True)]
    assert received[0].nbytes == sent[0].nbytes == pair.source.numel() * 4 * SPEC.num_layers
    for rank, cache in enumerate(pair.caches):
        for layer in range(SPEC.num_layers):
            k, v = cache.read_blocks(layer, dst)
            assert torch.equal(k, pair.source[0][:, :, rank : rank + 1]) and torch.equal(
                v, pair.source[1][:, :, rank : rank + 1]
            )
    pair.quiet()


def test_the_first_failed_part_ends_the_handoff_once_and_aborts_the_others(pair):
    dst = [1, 2, 4]
    pair.begin("r", dst)
    pair.ranks[1].receiver.abort("r#1.0", "rank 1 gave up")  # one rank's part fails on its own
    sent, received = pair.events(until_s=0.5)
    assert [(e.transfer_id, e.ok) for e in received] == [("r", False)]
    assert "rank 1 gave up" in str(received[0].error)
    assert pair.receiver.pending_transfers() == [] and sent == []  # the sender hears of it by its next piece
    pair.send_all("r", dst)  # queued: the NACKs come back by poll
    sent, received = pair.events()
    assert [(e.transfer_id, e.ok) for e in sent] == [("r", False)] and received == []  # once, every part let go
    assert not pair.sender.send_layer("r", 0, dst, pair.source[0], pair.source[1])  # nothing more goes
    pair.quiet()


def test_an_abort_ends_the_handoff_at_once_and_reports_it_once(pair):
    dst = [1, 2, 4]
    pair.begin("r", dst)
    pair.receiver.abort("r", "aborted by router")
    assert pair.receiver.pending_transfers() == []
    pair.send_all("r", dst)  # queued: the NACKs come back by poll
    sent, received = pair.events()
    assert [(e.transfer_id, e.ok, str(e.error)) for e in received] == [("r", False, "aborted by router")]
    assert [(e.transfer_id, e.ok) for e in sent] == [("r", False)]
    pair.quiet()


def test_a_receiver_made_for_one_rank_refuses_parts_from_several(pair):
    from transfer.wire import ModelFingerprint

    whole = ModelFingerprint.from_spec(SPEC)
    plain = LocalReceiver(whole, lambda *args: None, "local://plain", hub=LocalHub())
    receiver = HandoffReceiver.over(plain, HandoffLayout(whole, HEADS))
    try:
        with pytest.raises(ValueError, match="workers of one rank"):
            receiver.expect("r", [1], source_degree=2)
        sender = HandoffSender.over(LocalSender(whole, hub=LocalHub()), HandoffLayout(whole, HEADS))
        with pytest.raises(ValueError, match="workers of one rank"):
            sender.begin("r", "local://a|local://b")
        assert sender.active_transfers() == []
        sender.close()
    finally:
        receiver.close()
