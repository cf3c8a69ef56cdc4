"""KV tiers below the device (``kv_offload``): evicted prefix blocks kept in host memory and on disk, loaded back
instead of recomputed, token-exact against recomputing, with nothing leaked and no page trusted that fails its check.

The workload cycles through more prefixes than the device cache holds, so without tiers every prompt recomputes.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from engine.config import EngineConfig, KVOffloadConfig
from engine.kv_tiers import PAGE_HEADER, PAGE_SUFFIX, host_pool_folder
from engine.llm_engine import LLMEngine
from engine.request import RequestStatus, SamplingParams
from tests.helpers.engine import random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX_BLOCKS = 4  # 64-token prefixes at block size 16


def tenant_prompts(count: int, tenants: int, seed: int = 3) -> list[list[int]]:
    """``count`` prompts cycling through ``tenants`` 64-token prefixes, each with its own 4-token question."""
    prefixes = random_prompts(tenants, 64, 64, seed=seed)
    return [prefixes[i % tenants] + [5, 6, 7, i % 200] for i in range(count)]


@pytest.fixture(scope="module")
def expected(tiny_llama_path):
    """Greedy outputs of the workload on an engine whose cache holds every prefix (nothing recomputed or loaded)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=512))
    cache: dict[tuple[int, ...], list[int]] = {}

    def outputs(prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), params.max_tokens) not in cache]
        for prompt, result in zip(todo, engine.generate(todo, params)):
            cache[(tuple(prompt), params.max_tokens)] = result.token_ids
        return [cache[(tuple(p), params.max_tokens)] for p in prompts]

    return outputs


@pytest.fixture
def tiered(tiny_llama_path, tmp_path):
    """Engines with tiers (host pool named per test); after the test: no leak, and closing leaves no host pool."""
    engines: list[LLMEngine] = []
    pool = f"test-{uuid.uuid4().hex[:8]}"

    def factory(
        host_mb: int = 0, disk_mb: int = 0, disk_dir: Path | None = None, inline_io: bool = False, **overrides
    ) -> LLMEngine:
        offload = KVOffloadConfig(
            host_memory_mb=host_mb,
            disk_dir=str(disk_dir or tmp_path / "disk") if disk_mb else None,
            disk_mb=disk_mb,
            host_pool=pool,
            inline_io=inline_io,
        )
        settings = dict(model=str(tiny_llama_path), kv_blocks=12, kv_offload=offload)
        settings.update(overrides)
        engine = LLMEngine(EngineConfig(**settings))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.check_no_leaks()
        engine.close()
    assert not host_pool_folder(pool, b"\0" * 16).parent.exists(), "the host pool outlived its workers"


def run_one_by_one(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY):
    """One request at a time, giving the saver thread a moment, as requests arriving apart would."""
    results = []
    for prompt in prompts:
        results.extend(engine.generate([prompt], params))
        time.sleep(0.02)
    return results


def wait_saved(engine: LLMEngine, timeout_s: float = 5.0) -> None:
    """Until the saver thread has written every queued page."""
    assert engine.kv_tiers is not None
    deadline = time.monotonic() + timeout_s
    while engine.kv_tiers._saves.unfinished_tasks and time.monotonic() < deadline:  # noqa: SLF001
        time.sleep(0.01)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_evicted_prefixes_load_back_token_exact(tiered, expected, tier):
    engine = tiered(host_mb=8) if tier == "host" else tiered(disk_mb=8)
    prompts = tenant_prompts(12, 6)
    results = run_one_by_one(engine, prompts)
    assert [r.token_ids for r in results] == expected(prompts)
    # the device holds 12 blocks (3 prefixes): the first round computes, the second loads every prefix back
    assert [r.num_cached_tokens for r in results[6:]] == [64] * 6
    stats = engine.kv_tiers.stats
    assert stats.hit_tokens == {"host": 0, "disk": 0, tier: 6 * 64}
    assert stats.loads == 6 and stats.load_seconds > 0


def test_inline_io_pages_on_the_engines_thread_with_the_same_tokens(tiered, expected):
    """The simulation's mode: no tier thread runs; a page is on disk as soon as its block is evicted, and read back
    at the step that finds it, with the same tokens and hits as the threaded tiers."""
    engine = tiered(disk_mb=8, inline_io=True)
    assert not engine.kv_tiers._saver.is_alive() and not engine.kv_tiers._loader.is_alive()  # noqa: SLF001
    prompts = tenant_prompts(12, 6)
    results = [r for prompt in prompts for r in engine.generate([prompt], GREEDY)]  # no pause between requests
    assert [r.token_ids for r in results] == expected(prompts)
    assert [r.num_cached_tokens for r in results[6:]] == [64] * 6
    assert engine.kv_tiers.stats.hit_tokens == {"host": 0, "disk": 6 * 64}


def test_a_full_host_tier_evicts_to_disk_and_both_report_it(tiered, expected):
    engine = tiered(host_mb=1, disk_mb=8)
    # 30 prefixes (120 pages of 12.5 KiB) overflow the 1 MiB host tier into the disk below it
    prompts = tenant_prompts(60, 30)
    results = run_one_by_one(engine, prompts[:20])
    wait_saved(engine)
    first = dict(engine.kv_tiers.drain_events())
    assert set(first) == {"host"} and first["host"].stored  # nothing has fallen to the disk yet
    results += run_one_by_one(engine, prompts[20:])
    assert [r.token_ids for r in results] == expected(prompts)
    assert [r.num_cached_tokens for r in results[30:]] == [64] * 30
    stats = engine.kv_tiers.stats
    assert stats.hit_tokens["disk"] > 0 and stats.hit_tokens["host"] > 0
    assert stats.saved_bytes["host"] > 1024 * 1024 and stats.saved_bytes["disk"] > 0
    wait_saved(engine)
    later = dict(engine.kv_tiers.drain_events())
    assert set(later) == {"host", "disk"}
    removed = set(later["host"].removed)  # written, reported, then evicted to the disk below
    assert removed and removed <= set(first["host"].stored) and removed <= set(later["disk"].stored)
    engine.kv_tiers.resync_events()
    snapshot = dict(engine.kv_tiers.drain_events())
    assert snapshot["disk"].reset and set(snapshot["disk"].stored) == set(engine.kv_tiers.stores["disk"].snapshot())


def test_without_tiers_the_same_workload_recomputes(tiny_llama_path, expected, make_engine):
    engine = make_engine(tiny_llama_path, kv_blocks=12)
    prompts = tenant_prompts(12, 6)
    results = engine.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected(prompts)
    assert all(r.num_cached_tokens == 0 for r in results[6:])


def test_chunked_prefill_preemption_and_batches_stay_exact(tiered, expected):
    engine = tiered(host_mb=8, max_batch_tokens=24, kv_blocks=20)
    prompts = tenant_prompts(16, 8)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    run_one_by_one(engine, prompts[:8], params)  # every prefix goes down to the host tier
    results = engine.generate(prompts[8:], params)  # 8 at once: loads, chunks and preemptions interleave
    assert engine.scheduler.num_preemptions > 0
    assert sum(engine.kv_tiers.stats.hit_tokens.values()) > 0
    assert [r.token_ids for r in results] == expected(prompts[8:], params)


def test_a_reservation_counts_tier_hits_as_cached_and_takes_only_the_rest(tiered, tiny_llama_path, expected):
    from engine.kv_connector import KVBlocksReady

    decode = tiered(host_mb=8, kv_blocks=16)
    prefill = LLMEngine(EngineConfig(model=str(tiny_llama_path), kv_blocks=64, prefill_only=True))
    prompts = tenant_prompts(8, 4)
    run_one_by_one(decode, prompts[:4])  # the decode worker computed these prefixes once; they went to its host tier
    run_one_by_one(decode, tenant_prompts(4, 4, seed=9))  # other prefixes push them off the device
    wait_saved(decode)
    for i, prompt in enumerate(prompts[4:]):
        rid = f"r{i}"
        blocks = decode.kv_importer.reserve(prompt, GREEDY.copy(), rid, headroom_tokens=8, prefix_cache=True)
        assert blocks is not None
        held = decode.requests[rid]
        assert held.num_cached_tokens == 64 and held.num_loading_blocks == PREFIX_BLOCKS

        def sink(ready: KVBlocksReady, dst=blocks, rid=rid) -> None:
            decode.kv_importer.write(rid, ready.layer, dst[ready.first_block : ready.end_block], ready.k, ready.v)

        first_params = GREEDY.copy()
        first_params.max_tokens = 1
        prefill.add_request(prompt, first_params, rid, prefill_only=True, kv_sink=sink, export_from_token=64)
        [first] = [o for _ in range(50) if prefill.has_unfinished() for o in prefill.step()]
        prefill.release(rid)
        decode.kv_importer.tokens_in(rid, [first.new_token_ids[0]])
        assert decode.kv_importer.kv_done(rid)
        tokens = [first.new_token_ids[0]]
        while decode.has_unfinished():
            tokens += [t for o in decode.step() for t in o.new_token_ids]
        assert tokens == expected([prompt])[0]
    assert decode.kv_tiers.stats.hit_tokens["host"] == 4 * 64
    prefill.check_no_leaks()


def test_workers_of_a_node_share_the_host_tier(tiered, expected):
    first, second = tiered(host_mb=8), tiered(host_mb=8)
    prompts = tenant_prompts(12, 6)
    run_one_by_one(first, prompts[:6])
    run_one_by_one(first, tenant_prompts(6, 6, seed=9))  # first's device forgets them; its host tier keeps them
    wait_saved(first)
    results = run_one_by_one(second, prompts[6:])  # never computed there
    assert [r.token_ids for r in results] == expected(prompts[6:])
    assert second.kv_tiers.stats.hit_tokens["host"] == 6 * 64


def test_the_disk_tier_outlives_the_worker(tiered, expected, tmp_path):
    before = tiered(disk_mb=8)
    prompts = tenant_prompts(12, 6)
    run_one_by_one(before, prompts[:6] + tenant_prompts(6, 6, seed=9))
    before.close()  # a restart: the engine goes, its disk folder stays
    after = tiered(disk_mb=8)
    results = run_one_by_one(after, prompts[6:])
    assert [r.token_ids for r in results] == expected(prompts[6:])
    assert after.kv_tiers.stats.hit_tokens["disk"] == 6 * 64


def _pages(engine: LLMEngine, tier: str) -> list[Path]:
    return sorted(engine.kv_tiers.stores[tier].folder.glob(f"*{PAGE_SUFFIX}"))


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "foreign", "other_tokens"])
def test_a_bad_page_is_recomputed_never_used(tiered, expected, damage, caplog):
    before = tiered(disk_mb=8)
    prompts = tenant_prompts(4, 4)
    run_one_by_one(before, prompts + tenant_prompts(4, 4, seed=9))
    before.close()
    pages = _pages(before, "disk")
    assert len(pages) >= 4 * PREFIX_BLOCKS  # the first four prefixes at least went down
    for page in pages:
        data = bytearray(page.read_bytes())
        if damage == "corrupted":
            data[-100] ^= 0xFF
        elif damage == "truncated":
            del data[len(data) // 2 :]
        elif damage == "foreign":
            data[8:24] = bytes(16)  # another model's fingerprint
        else:
            data[PAGE_HEADER.size] ^= 1  # the first token id differs: a hash collision
        page.write_bytes(bytes(data))
    after = tiered(disk_mb=8)
    results = run_one_by_one(after, prompts)
    assert [r.token_ids for r in results] == expected(prompts)
    assert sum(after.kv_tiers.stats.hit_tokens.values()) == 0
    assert all(r.num_cached_tokens == 0 for r in results)
    assert "is unusable" in caplog.text  # found, checked, deleted


def test_an_unwritable_disk_turns_the_tier_off_and_serving_goes_on(tiered, expected, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the disk tier's folder would be")
    engine = tiered(disk_mb=8, disk_dir=blocked)
    assert "cannot use" in engine.kv_tiers.stores["disk"].disabled
    prompts = tenant_prompts(12, 6)
    assert [r.token_ids for r in run_one_by_one(engine, prompts)] == expected(prompts)


def test_a_disk_that_fails_mid_run_turns_the_tier_off(tiered, expected, tmp_path):
    engine = tiered(disk_mb=8, disk_dir=tmp_path / "disk")
    folder = engine.kv_tiers.stores["disk"].folder
    prompts = tenant_prompts(24, 6)
    run_one_by_one(engine, prompts[:6])
    for page in folder.iterdir():  # the folder goes and a file takes its place: every later write fails
        page.unlink()
    folder.rmdir()
    folder.write_text("gone")
    results = run_one_by_one(engine, prompts[6:])
    assert [r.token_ids for r in results] == expected(prompts[6:])
    assert "writing a page failed" in engine.kv_tiers.stores["disk"].disabled


def test_abort_while_loading_leaks_nothing(tiered, expected):
    engine = tiered(host_mb=8)
    prompts = tenant_prompts(12, 6)
    run_one_by_one(engine, prompts[:6] + tenant_prompts(6, 6, seed=9))
    wait_saved(engine)
    rid = engine.add_request(prompts[6], GREEDY.copy())
    engine.step()  # admitted: its prefix is in the host tier
    assert engine.requests[rid].status == RequestStatus.LOADING
    assert engine.abort(rid)
    survivor = engine.generate([prompts[7]], GREEDY)  # takes the freed blocks while the aborted load may finish
    assert survivor[0].token_ids == expected([prompts[7]])[0]
    time.sleep(0.1)
    engine.step()


def test_offload_config_errors_name_the_field(tiny_llama_path):
    with pytest.raises(ValueError, match="kv_offload.disk_dir and kv_offload.disk_mb"):
        KVOffloadConfig(disk_dir="/tmp/x")
    with pytest.raises(ValueError, match="kv_offload.host_memory_mb"):
        KVOffloadConfig(host_memory_mb=-1)
    with pytest.raises(ValueError, match="kv_offload.host_pool"):
        KVOffloadConfig(host_memory_mb=1, host_pool="../etc")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offload=KVOffloadConfig(host_memory_mb=1), enable_prefix_caching=False)


def test_a_host_pool_whose_workers_were_all_killed_is_swept_by_the_next_one(tiered):
    import os
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = host_pool_folder(f"killed-{uuid.uuid4().hex[:8]}", bytes(range(16)))
    (stale / ".holders").mkdir(parents=True)
    (stale / ".holders" / f"{dead.stdout.strip()}-deadbeef").touch()
    (stale / f"{1:016x}{PAGE_SUFFIX}").write_bytes(b"a page nobody will read")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    engine = tiered(host_mb=1)
    assert not stale.parent.exists()  # gone with its pool folder
    assert engine.kv_tiers.stores["host"].folder.is_dir()  # ours stays
