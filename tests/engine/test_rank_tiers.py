"""KV tiers at tensor_parallel_size 2 (``engine.rank_tiers``) on the CPU over gloo: each rank pages its own heads of the
same blocks, and a block comes back only when both ranks' pages of it are there and checked.

The workload cycles through more prefixes than the device cache holds (as tests/engine/test_kv_tiers.py), so the
second round loads every prefix back. Outputs are compared with one rank's, token for token, and the logprob of every
chosen token within ``LOGPROB_TOLERANCE`` (float32; the ranks' partial sums add in another order: the largest gap is
printed).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import torch

from engine.blocks import prompt_block_hashes
from engine.config import EngineConfig, KVOffloadConfig
from engine.kv_tiers import PAGE_SUFFIX, host_pool_folder
from engine.tensor_parallel import StepKind, StepMessage
from engine.tp_launch import run_ranks
from tests.helpers.engine import random_prompts

LOGPROB_TOLERANCE = 1e-4
BLOCK_SIZE = 16
TENANTS = 6
PREFIX_BLOCKS = 4  # 64-token prefixes
DAMAGED_BLOCK = 2  # the page of tenant 0's third block, on rank 1 only


def tenant_prompts() -> list[list[int]]:
    """Two rounds over ``TENANTS`` 64-token prefixes, each prompt with a 4-token question of its own."""
    prefixes = random_prompts(TENANTS, 64, 64, seed=3)
    return [prefixes[i % TENANTS] + [5, 6, 7, i] for i in range(2 * TENANTS)]


def _pages(folder: Path) -> set[int]:
    return {int(p.name[: -len(PAGE_SUFFIX)], 16) for p in folder.glob(f"*{PAGE_SUFFIX}")}


def _wait(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _config(run: dict, size: int) -> EngineConfig:
    offload = KVOffloadConfig(
        host_memory_mb=run["host_mb"], disk_dir=run["disk_dir"], disk_mb=run["disk_mb"], host_pool=run["pool"]
    )
    return EngineConfig(
        model=run["model"],
        dtype="float32",
        kv_blocks=12,  # three prompts' blocks: every prefix is evicted before the second round asks for it
        block_size=BLOCK_SIZE,
        tensor_parallel_size=size,
        kv_offload=offload,
        compile_decode_background=False,
    )


def _tier_folders(run: dict, tier: str) -> Path:
    """The folder holding every rank's folder of ``tier`` (one per fingerprint)."""
    if tier == "disk":
        return Path(run["disk_dir"])
    return host_pool_folder(run["pool"], b"\0" * 16).parent


def _rank_main(rank: int, size: int, store_path: str, run: dict) -> dict:
    import torch.distributed as dist

    from engine.engine_parts import build_engine_parts
    from engine.llm_engine import LLMEngine
    from engine.rank_tiers import follower_tiers
    from engine.request import SamplingParams
    from engine.tensor_parallel import StepChannel, TPFollower, TPGroup

    torch.set_num_threads(1)
    group = TPGroup(dist.FileStore(store_path, size), rank, size, 60.0) if size > 1 else None
    config = _config(run, size)
    if rank > 0:
        parts = build_engine_parts(config, group)
        tiers = follower_tiers(parts)
        assert tiers is not None
        ended = TPFollower(parts.runner, StepChannel(group), tiers=tiers).serve()
        assert group is not None
        group.close()
        folders = {name: str(store.folder) for name, store in tiers.tiers.stores.items()}
        return {"ended": ended, "loads_left": len(tiers.loads), "folders": folders}
    engine = LLMEngine(config, group)
    assert engine.kv_tiers is not None
    tier = run["tier"]
    own = engine.kv_tiers.stores[tier].folder
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = tenant_prompts()
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    cached: dict[str, int] = {}

    def serve(index: int) -> None:
        rid = engine.add_request(prompts[index], params.copy(), request_id=f"r{index}")
        if run.get("abort") and index == TENANTS:  # aborted while its prefix is being read on both ranks
            engine.step()
            result["aborted_while"] = engine.requests[rid].status.name
            assert engine.abort(rid)
        while engine.has_unfinished():
            for out in engine.step():
                assert out.error is None, out.error
                tokens.setdefault(rid, []).extend(out.new_token_ids)
                logprobs.setdefault(rid, []).extend(lp.logprob for lp in out.logprobs or [])
                if out.finished:
                    cached[rid] = out.num_cached_tokens
        time.sleep(0.02)  # requests arriving apart: the saver threads get a moment

    result: dict = {}
    for index in range(TENANTS):
        serve(index)
    if size > 1:  # both ranks hold the same pages; only rank 0's tiers report them
        assert _wait(lambda: not engine.kv_tiers._saves.unfinished_tasks)  # noqa: SLF001
        theirs = next(folder for folder in _tier_folders(run, tier).iterdir() if folder.is_dir() and folder != own)
        mine = _pages(own)
        result["follower_has_every_page"] = _wait(lambda: mine <= _pages(theirs))
        events = dict(engine.kv_tiers.drain_events())
        result["events_stored"] = sorted(events[tier].stored) if tier in events else []
        result["pages"] = sorted(mine)
        result["follower_folder"] = str(theirs)
        damaged = prompt_block_hashes(prompts[0], BLOCK_SIZE)[DAMAGED_BLOCK]
        page = theirs / f"{damaged:016x}{PAGE_SUFFIX}"
        if run["damage"] == "missing":
            page.unlink()
        elif run["damage"] == "corrupted":
            data = bytearray(page.read_bytes())
            data[-100] ^= 0xFF
            page.write_bytes(bytes(data))
    for index in range(TENANTS, 2 * TENANTS):
        serve(index)
    engine.check_no_leaks()
    assert not engine.kv_tiers.has_pending()
    stats = engine.kv_tiers.stats
    engine.close()
    return result | {
        "tokens": tokens,
        "logprobs": logprobs,
        "cached": cached,
        "hit_tokens": sum(stats.hit_tokens.values()),
        "loads": stats.loads,
        "kv_heads": engine.kv_spec.num_kv_heads,
    }


def _run(size: int, run: dict) -> dict[int, dict]:
    if size > 1:
        return run_ranks(_rank_main, size, run, timeout_s=240)
    threads = torch.get_num_threads()
    try:
        return {0: _rank_main(0, 1, "", run)}
    finally:
        torch.set_num_threads(threads)


def _settings(tiny_llama_path: Path, tmp_path: Path, tier: str, damage: str = "none") -> dict:
    return {
        "model": str(tiny_llama_path),
        "tier": tier,
        "damage": damage,
        "pool": f"test-{uuid.uuid4().hex[:8]}",
        "host_mb": 8 if tier == "host" else 0,
        "disk_dir": str(tmp_path / "disk") if tier == "disk" else None,
        "disk_mb": 8 if tier == "disk" else 0,
    }


@pytest.fixture(scope="module")
def one_rank(tiny_llama_path, tmp_path_factory) -> dict:
    """The workload on one rank with a host tier: the outputs degree 2 must give."""
    return _run(1, _settings(tiny_llama_path, tmp_path_factory.mktemp("one-rank"), "host"))[0]


def _compare(one: dict, two: dict) -> float:
    assert two["tokens"] == one["tokens"]
    gap = max(
        abs(a - b) for rid in one["logprobs"] for a, b in zip(one["logprobs"][rid], two["logprobs"][rid], strict=True)
    )
    print(f"largest logprob gap against one rank: {gap:.2e}")
    assert gap < LOGPROB_TOLERANCE
    return gap


def test_one_rank_loads_every_prefix_back(one_rank):
    assert one_rank["hit_tokens"] == TENANTS * PREFIX_BLOCKS * BLOCK_SIZE
    assert [one_rank["cached"][f"r{i}"] for i in range(TENANTS, 2 * TENANTS)] == [64] * TENANTS


@pytest.mark.parametrize("tier", ["host", pytest.param("disk", marks=pytest.mark.e2e)])  # disk: `make test-e2e`
def test_two_ranks_page_their_own_heads_and_load_them_back_as_one_rank_does(tiny_llama_path, tmp_path, one_rank, tier):
    run = _settings(tiny_llama_path, tmp_path, tier)
    ranks = _run(2, run)
    leader, follower = ranks[0], ranks[1]
    _compare(one_rank, leader)
    assert leader["kv_heads"] == 1  # each rank holds one of the model's two KV heads
    assert leader["hit_tokens"] == TENANTS * PREFIX_BLOCKS * BLOCK_SIZE and leader["loads"] == TENANTS
    assert leader["cached"] == one_rank["cached"]
    # each rank has its own folder of the same pages; rank 0's events alone name them, each once
    assert leader["follower_has_every_page"] and leader["pages"]
    assert follower["folders"][tier] == leader["follower_folder"]
    assert leader["events_stored"] == leader["pages"]
    assert follower["ended"] == "stop" and follower["loads_left"] == 0
    if tier == "host":
        assert not _tier_folders(run, "host").exists(), "the host pool outlived its ranks"


@pytest.mark.parametrize("damage", ["missing", pytest.param("corrupted", marks=pytest.mark.e2e)])
def test_a_page_bad_on_one_rank_only_is_recomputed_on_both(tiny_llama_path, tmp_path, one_rank, damage):
    run = _settings(tiny_llama_path, tmp_path, "disk", damage)
    ranks = _run(2, run)
    leader, follower = ranks[0], ranks[1]
    _compare(one_rank, leader)
    # tenant 0's prefix: rank 0 read its four pages, rank 1 two; the block whose page it lacked and the one after it
    # were computed on both ranks
    lost = (PREFIX_BLOCKS - DAMAGED_BLOCK) * BLOCK_SIZE
    assert leader["cached"][f"r{TENANTS}"] == DAMAGED_BLOCK * BLOCK_SIZE
    assert leader["hit_tokens"] == TENANTS * PREFIX_BLOCKS * BLOCK_SIZE - lost
    assert follower["ended"] == "stop" and follower["loads_left"] == 0
    # computed again and evicted again, the block went down to rank 1's disk tier once more (rank 0 held it)
    damaged = prompt_block_hashes(tenant_prompts()[0], BLOCK_SIZE)[DAMAGED_BLOCK]
    assert damaged in _pages(Path(leader["follower_folder"]))


def test_an_abort_while_both_ranks_load_leaks_nothing_on_either(tiny_llama_path, tmp_path, one_rank):
    run = _settings(tiny_llama_path, tmp_path, "host") | {"abort": True}
    ranks = _run(2, run)
    leader, follower = ranks[0], ranks[1]
    assert leader["aborted_while"] == "LOADING"
    aborted = f"r{TENANTS}"
    assert aborted not in leader["tokens"]
    others = {key: {rid: v for rid, v in one_rank[key].items() if rid != aborted} for key in ("tokens", "logprobs")}
    _compare(others, leader)  # the aborted load's blocks, reused at once, hold the next requests' own KV
    assert follower["ended"] == "stop" and follower["loads_left"] == 0


def test_kv_offload_is_accepted_at_any_degree():
    config = EngineConfig(kv_offload=KVOffloadConfig(host_memory_mb=1), tensor_parallel_size=2)
    assert config.kv_offload is not None and config.kv_offload.enabled


def test_a_tiers_message_round_trips_with_its_reply_flag():
    message = StepMessage(StepKind.TIERS, control=b"\x81\xa4load\x01", reply=True)
    decoded = StepMessage.decode(StepKind.TIERS, message.encode())
    assert decoded.kind == StepKind.TIERS and decoded.control == message.control and decoded.reply
