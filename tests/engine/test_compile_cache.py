"""The compiled decode step kept on disk (``engine.compile_cache``): a second start loads what the first compiled,
and an entry that is corrupt or made for something else is removed and compiled again, never run.

Compiles cost tens of seconds on 2 cores, so these tests share the tiny Llama's entries in ``$PDSERVE_CACHE`` with
tests/engine/test_decode_graphs.py (same settings, same batch sizes), and each test that must compile afresh does so
once, into a copy of those entries under its own cache directory.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest

from engine.compile_cache import MANIFEST, CompiledStore, KeptStepLoader, store_root, vec_isas
from engine.cpu_info import cpu_fingerprint, cpu_model
from engine.decode_graphs import Fallback
from engine.request import SamplingParams
from tests.helpers.engine import random_prompts

SETTINGS = dict(block_size=4, max_num_seqs=6, max_model_len=256, max_batch_tokens=64)
BATCHES = [2]


def _greedy_tokens(engine) -> list[list[int]]:
    prompts = random_prompts(2, 4, 10, seed=21)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params)]


@pytest.fixture
def kept(make_engine, tiny_llama_path):
    """An engine whose compiled step for BATCHES is on disk (compiled now, or by an earlier test or run), its
    tokens, and its entry."""
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES)
    graphs = engine.runner.decode_graphs
    assert set(graphs.compile_s) == set(BATCHES) and not graphs._broken
    return engine, _greedy_tokens(engine), CompiledStore(graphs.cache_fields())


def _copy_to(tmp_path, monkeypatch, store: CompiledStore) -> CompiledStore:
    """The entry (and the kept CPU-linear forms) copied under a cache directory of this test's own."""
    root = tmp_path / "cache" / "compiled"
    root.mkdir(parents=True)
    shutil.copytree(store.dir, root / store.key)
    for forms in store_root().glob("linear-forms-*.json"):
        shutil.copy(forms, root / forms.name)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return CompiledStore(store.fields, root)


def test_a_second_engine_loads_the_kept_step_and_is_token_exact(kept, make_engine, tiny_llama_path):
    engine, tokens, store = kept
    held = store.verified_batches()  # BATCHES, and any other sizes an earlier run kept under this key
    again = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES)
    graphs = again.runner.decode_graphs
    assert graphs.loaded == set(BATCHES) and CompiledStore(graphs.cache_fields()).key == store.key
    assert _greedy_tokens(again) == tokens
    assert sum(graphs.steps.values()) > 5 and Fallback.CAPTURE_FAILED not in graphs.fallbacks
    assert set(BATCHES) <= held and store.verified_batches() == held  # loading left the entry as it was


def _damage(store: CompiledStore, damage: str) -> None:
    if damage == "graph":
        path = store.graph_path(BATCHES[0])
        path.write_bytes(path.read_bytes()[:-100] + bytes(100))
    elif damage == "kernel":
        kernel = next(p for p in store.inductor_dir.rglob("*.so"))
        kernel.write_bytes(b"\0" * kernel.stat().st_size)
    elif damage == "manifest":
        (store.dir / MANIFEST).write_text("{not json")
    elif damage == "foreign":  # another machine's entry under this key
        manifest = json.loads((store.dir / MANIFEST).read_text())
        manifest["fields"]["cpu"] = "another-cpu"
        (store.dir / MANIFEST).write_text(json.dumps(manifest))
    else:
        (store.inductor_dir / "planted.py").write_text("raise SystemExit('never run')\n")


@pytest.mark.parametrize("damage", ["graph", "kernel", "manifest", "foreign", "extra"])
def test_a_corrupt_or_foreign_entry_is_not_trusted(kept, tmp_path, monkeypatch, damage):
    """Found before anything of the entry is read as code: the entry is removed."""
    copy = _copy_to(tmp_path, monkeypatch, kept[2])
    assert copy.verified_batches() >= set(BATCHES)  # and any sizes an earlier run kept under this key
    _damage(copy, damage)
    assert copy.verified_batches() == set() and not copy.dir.exists()


def test_an_engine_on_a_corrupt_entry_compiles_again_and_is_correct(
    kept, make_engine, tiny_llama_path, tmp_path, monkeypatch
):
    engine, tokens, store = kept
    copy = _copy_to(tmp_path, monkeypatch, store)
    _damage(copy, "graph")
    again = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES)
    graphs = again.runner.decode_graphs
    assert graphs.loaded == set() and set(graphs.compile_s) == set(BATCHES) and not graphs._broken
    assert _greedy_tokens(again) == tokens
    assert copy.verified_batches() == set(BATCHES)  # compiled again, and kept


def test_the_kept_forms_of_the_cpu_linears_are_reused(kept, make_engine, tiny_llama_path):
    engine, _, _ = kept
    again = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES)
    first = next(m.table for m in engine.model.modules() if hasattr(m, "table"))
    second = next(m.table for m in again.model.modules() if hasattr(m, "table"))
    assert second.forms == first.forms and second.pass_ms == {}  # taken from disk, not timed


def test_a_serving_start_loads_the_smallest_kept_size_before_serving(kept, make_engine, tiny_llama_path):
    """With ``compile_decode_background`` (the serving configs) a kept entry loads through ``KeptStepLoader``: the
    smallest size before the start returns (here the only one), nothing compiles."""
    _, tokens, _ = kept
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES, compile_decode_background=True)
    graphs = engine.runner.decode_graphs
    assert graphs._background is None and graphs.loaded == set(BATCHES) and graphs._loader is None
    assert _greedy_tokens(engine) == tokens and sum(graphs.steps.values()) > 5


def test_a_size_loads_on_the_thread_when_a_step_first_meets_it(kept, make_engine, tiny_llama_path):
    """A size not yet loaded: its steps run eagerly (``LOADING``) while the thread loads it, asked for by the
    first such step, and the steps after it run on the loaded graph, with the same tokens."""
    _, tokens, store = kept
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES)
    graphs = engine.runner.decode_graphs
    graphs._compiled, graphs.loaded = {}, set()  # as a start leaves the sizes it has not met yet
    loader = graphs._loader = KeptStepLoader(CompiledStore(graphs.cache_fields()), BATCHES)
    time.sleep(0.2)
    assert not loader.loaded  # nothing is loaded before a step asks
    assert _greedy_tokens(engine) == tokens
    assert graphs.fallbacks[Fallback.LOADING] > 0 and loader.wait_loaded(BATCHES[0], 60)
    assert _greedy_tokens(engine) == tokens
    assert graphs.loaded == set(BATCHES) and graphs._loader is None and not graphs._broken
    assert sum(graphs.steps.values()) > 5 and loader.done  # it ends once every size is in


def test_a_load_that_fails_on_the_thread_leaves_the_engine_eager(
    kept, make_engine, tiny_llama_path, tmp_path, monkeypatch
):
    """An entry damaged after the start's check: the thread's own check removes it, and the engine stays eager
    with the same tokens (never a step half loaded)."""
    _, tokens, store = kept
    copy = _copy_to(tmp_path, monkeypatch, store)
    engine = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES)
    graphs = engine.runner.decode_graphs
    _damage(copy, "graph")
    graphs._compiled, graphs.loaded = {}, set()  # as the start leaves them before a load on a thread
    graphs._loader = KeptStepLoader(CompiledStore(graphs.cache_fields()), BATCHES)
    graphs._loader.want(BATCHES[0])
    assert not graphs._loader.wait_loaded(BATCHES[0], 60) and graphs._loader.error and not graphs._loader.loaded
    assert _greedy_tokens(engine) == tokens
    assert graphs._loader is None and graphs._broken and not graphs.steps
    assert not copy.dir.exists()  # removed, to be compiled again by the next start


@pytest.mark.e2e  # a compile in another process: about a minute on 2 cores
def test_a_cold_step_compiles_in_the_background_while_the_engine_serves_eagerly(
    kept, make_engine, tiny_llama_path, tmp_path, monkeypatch
):
    engine, tokens, store = kept
    copy = _copy_to(tmp_path, monkeypatch, store)
    copy.clear()  # the kept linear forms stay: the same key
    started = time.perf_counter()
    again = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES, compile_decode_background=True)
    graphs = again.runner.decode_graphs
    assert graphs._background is not None and time.perf_counter() - started < 30
    assert _greedy_tokens(again) == tokens  # eagerly, meanwhile
    assert graphs.fallbacks[Fallback.COMPILING] > 0 and not graphs.steps
    assert graphs._background.wait(timeout=600) == 0
    assert _greedy_tokens(again) == tokens  # the first step after the exit loads the kept step
    assert graphs.loaded == set(BATCHES) and sum(graphs.steps.values()) > 5
    assert copy.verified_batches() >= set(BATCHES)


@pytest.mark.e2e  # a child process that loads the entry: about 20 s on 2 cores
def test_a_start_while_another_process_holds_the_entry_does_not_wait(kept, make_engine, tiny_llama_path):
    engine, tokens, store = kept
    with store.locked():  # as a background compile of another worker would
        started = time.perf_counter()
        again = make_engine(tiny_llama_path, **SETTINGS, compile_decode_batches=BATCHES, compile_decode_background=True)
        graphs = again.runner.decode_graphs
        assert graphs._background is not None and time.perf_counter() - started < 30
    assert graphs._background.wait(timeout=300) == 0  # its child waited for the entry, found it whole
    assert _greedy_tokens(again) == tokens and graphs.loaded == set(BATCHES)


def test_the_cpu_is_named_and_fingerprinted():
    assert cpu_model() and "cores" in cpu_model()
    assert cpu_fingerprint() == cpu_fingerprint() and len(cpu_fingerprint()) == 16


def test_a_load_skips_inductors_isa_probes_only_where_the_compile_found_every_isa_usable(tmp_path):
    """The manifest keeps the ISAs inductor found usable while compiling; a load takes them as they are (no base
    probe in a subprocess per ISA) only when they are every ISA the CPU's flags allow, else it probes as before."""
    from torch._inductor import config

    store = CompiledStore({"model": "m"}, tmp_path)
    store.dir.mkdir(parents=True)
    store.record(set())
    manifest = json.loads((store.dir / MANIFEST).read_text())
    assert manifest["vec_isas"] == vec_isas(True)
    for recorded, trusted in [(vec_isas(False), True), ([*vec_isas(False), "another"], False), (None, False)]:
        manifest["vec_isas"] = recorded
        (store.dir / MANIFEST).write_text(json.dumps(manifest))
        with store.vec_isas_kept() as kept:
            assert kept is trusted and config.cpp.vec_isa_ok is (True if trusted else None)
        assert config.cpp.vec_isa_ok is None
    assert store.verified_batches() == set()  # the ISAs are not among what the entry is checked against
