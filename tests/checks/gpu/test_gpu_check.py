"""`make gpu-check`'s script, run the way CI can: `--device cpu --tiny --quick`, as a separate process, the same code
path as the first GPU run.

It checks what a user reading the JSON relies on: one object printed and written to `--out`, the sections in order of
value, greedy tokens exact against transformers and across the prefill/decode pair in float32, both generate
baselines warmed on what they time and the goals against the faster, the SDPA kernel of every attention path, what
the machine lacks named in the JSON; and that a run cut short tells what it did: a run killed at any moment leaves a
valid JSON with every finished section, the watchdog ends a run at its hard limit with the section it cut, and no
measurement waits for a request that has failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from checks.gpu import gpu_check, gpu_check_engine, gpu_check_models
from checks.gpu.gpu_check_time import Deadline, OutOfTime
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from transfer.shm_ring import PREFIX, SHM_DIR

REPO = Path(__file__).resolve().parents[3]
SCRIPT = str(REPO / "checks" / "gpu" / "gpu_check.py")
GOAL_NAMES = [
    "decode_b1_vs_eager",
    "decode_b1_vs_generate",
    "decode_b128_vs_generate",
    "prefill_vs_forward",
    "itl_p99_during_vs_idle",
]
SECTIONS_IN_ORDER = [  # the quick run's order of value
    "model", "exact_float32", "decode", "sdpa_kernels", "prefill_decode_pair", "memory", "prefill",
    "decode_other_backends",
]  # fmt: skip
ENV = {**os.environ, "PYTHONPATH": ""}  # the script makes the repository importable itself, as on a GPU box


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)} if os.path.isdir(SHM_DIR) else set()


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    before = _segments()
    command = [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--quick", "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=280, cwd=str(out.parent), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _segments() - before == set(), "the prefill/decode pair left a shared-memory segment"
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    return printed, json.loads(out.read_text())


pytestmark = pytest.mark.timeout(300)


def test_one_json_object_printed_and_written(result):
    printed, written = result
    assert printed == written
    assert written["check"] == "gpu-check" and written["tiny"] is True and written["mode"] == "quick"
    assert written["environment"]["device"] == "cpu" and 0 < written["wall_s"] < written["budget_s"]
    assert "aborted" not in written


def test_sections_run_in_order_of_value_and_each_reports_its_time(result):
    _, data = result
    primary = data["primary"]
    assert [k for k in primary if k in SECTIONS_IN_ORDER] == SECTIONS_IN_ORDER
    for name in SECTIONS_IN_ORDER:
        seconds = primary[name]["section_s"] if isinstance(primary[name], dict) else primary[f"{name}_section_s"]
        assert seconds >= 0
        if name != "memory":  # memory's error is "not on a GPU", checked below
            assert "error" not in (primary[name] if isinstance(primary[name], dict) else {}), primary[name]
    assert primary["transformers"]["generate_compiled"]["section_s"] >= 0  # the decode section's other baseline
    assert "llama_3_8b" not in data  # the quick run is the 1B shape only


def test_greedy_tokens_are_exact_in_float32_against_transformers_and_across_the_pair(result):
    _, data = result
    primary = data["primary"]
    assert primary["exact_float32"]["exact"] is True
    assert primary["exact_float32"]["exact_rows"] == primary["exact_float32"]["rows"] > 0
    pair = primary["prefill_decode_pair"]
    # over nccl: gloo on the CPU (a GPU cache would take the CUDA IPC path: direct_pieces > 0)
    assert pair["exact"] == {
        "rows": 2,
        "exact_rows": 2,
        "exact": True,
        "dtype": "float32",
        "backend": "nccl",
        "direct_pieces": 0,
    }
    assert pair["bfloat16"]["positions"] > 0 and 0.5 <= pair["bfloat16"]["top1_agreement"] <= 1
    assert data["exact"]["float32_vs_generate"] is True
    assert data["exact"]["prefill_decode_pair_float32_vs_single_engine"] is True
    top1 = primary["prefill"]["top1_bfloat16"]
    assert top1["positions"] > 0 and 0.5 <= top1["top1_agreement"] <= 1


def test_decode_rows_and_the_other_backends_after_a_smoke_forward(result):
    _, data = result
    primary = data["primary"]
    assert [(r["attention_backend"], r["cuda_graphs"]) for r in primary["decode"]] == [("auto", True), ("sdpa", False)]
    for row in primary["decode"]:
        assert "error" not in row and row["smoke_s"] >= 0
        assert set(row["tokens_per_s"]) == {"1", "4"} and all(v > 0 for v in row["tokens_per_s"].values())
    others = primary["decode_other_backends"]
    assert [(r["attention_backend"], r["cuda_graphs"]) for r in others["rows"]] == [("flex", False), ("flex", True)]
    assert all(r["tokens_per_s"]["4"] > 0 for r in others["rows"])
    assert "not importable" in others["skipped"]["flashinfer"]  # not installed here: named, not run
    assert "auto resolves to sdpa" in others["skipped"]["sdpa+graphs"]


def test_both_generate_baselines_and_goals_against_the_faster(result):
    _, data = result
    primary = data["primary"]
    eager = primary["transformers"]["generate_eager_tokens_per_s"]
    compiled = primary["transformers"]["generate_compiled"]
    assert set(eager) == set(compiled["tokens_per_s"]) == {"1", "4"}
    assert compiled["compiled"] is False  # transformers compiles only on CUDA: said, not hidden
    goals = {g["goal"]: g for g in data["goals"]}
    assert list(goals) == GOAL_NAMES
    auto = primary["decode"][0]["tokens_per_s"]
    for name, batch in (("decode_b1_vs_generate", "1"), ("decode_b128_vs_generate", "4")):
        faster = max(eager[batch], compiled["tokens_per_s"][batch])
        which = "eager" if eager[batch] >= compiled["tokens_per_s"][batch] else "compiled"
        assert goals[name]["value"] == pytest.approx(auto[batch] / faster, abs=1e-3)
        assert goals[name]["baseline"] == f"generate {which}"
    assert goals["decode_b1_vs_eager"]["value"] == pytest.approx(
        auto["1"] / primary["decode"][1]["tokens_per_s"]["1"], abs=1e-3
    )
    pair = primary["prefill_decode_pair"]
    assert goals["itl_p99_during_vs_idle"]["value"] == pytest.approx(
        pair["itl_during_p99_ms"] / pair["itl_idle_p99_ms"], abs=1e-3
    )
    for goal in goals.values():
        assert goal["passed"] is (
            goal["value"] >= goal["target"] if goal["op"] == "ge" else goal["value"] <= goal["target"]
        )


def test_every_attention_path_names_its_sdpa_kernel(result):
    _, data = result
    kernels = data["primary"]["sdpa_kernels"]
    paths = ["prefill", "decode_masked", "prefill_with_context", "decode_unmasked", "decode_graph_step"]
    assert list(kernels["paths"]) == paths and all(kernels["paths"][p] for p in paths)
    assert kernels["math_anywhere"] is False and kernels["dtype"] == "bfloat16"


def test_pair_memory_and_dependencies_are_reported(result):
    _, data = result
    primary = data["primary"]
    pair = primary["prefill_decode_pair"]
    assert pair["transfer_gbps"] > 0 and pair["kv_bytes_per_long_prompt"] > 0
    assert pair["itl_idle_p99_ms"] > 0 and pair["itl_during_p99_ms"] > 0 and pair["itl_samples"]["during"] > 0
    assert pair["graphs_warmed"] is None and pair["graphs_captured_while_measuring"] is None  # no graphs on the CPU
    assert pair["direct_pieces"] == 0  # the CPU pair's cache is not offered (a GPU's would be, through CUDA IPC)
    assert primary["memory"]["error"] == "not on a GPU" and primary["memory"]["measured"]["weights_bytes"] > 0
    deps = data["dependencies"]
    assert deps["torch"] == torch.__version__.split("+")[0] or deps["torch"].startswith(torch.__version__[:4])
    assert deps["flashinfer"] == "missing (pip: flashinfer-python)" and deps["zmq"] != "missing (pip: pyzmq)"


def _read_when(path: Path, ready, timeout_s: float) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.exists():
            data = json.loads(path.read_text())  # written atomically: never half a file
            if ready(data):
                return data
        time.sleep(0.05)
    raise AssertionError(f"{path} never held what was waited for")


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): a run killed midway
def test_a_killed_run_keeps_every_finished_section(tmp_path):
    out = tmp_path / "killed.json"
    command = [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--quick", "--out", str(out)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, cwd=tmp_path)
    try:
        data = _read_when(out, lambda d: "sdpa_kernels" in d.get("primary", {}), 200)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert data["primary"]["exact_float32"]["exact"] is True and data["primary"]["decode"]
    again = json.loads(out.read_text())  # what the killed run left: valid, with what had finished
    assert again["primary"]["exact_float32"]["exact"] is True
    assert [g["goal"] for g in again["goals"]] == GOAL_NAMES


@pytest.mark.e2e  # `make test-e2e` (for the suite's 20 minutes): a run past its limit
def test_the_watchdog_ends_the_run_at_its_hard_limit_and_says_where(tmp_path):
    out = tmp_path / "cut.json"
    before = _segments()
    command = [sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--quick", "--out", str(out), "--hard-limit-s", "3"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert proc.returncode == gpu_check.ABORT_STATUS, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["aborted"].startswith("the hard limit of 3 s passed while running")
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == data
    assert data["wall_s"] < 20
    end = time.monotonic() + 10
    while _segments() - before and time.monotonic() < end:  # a cut pair's processes exit when their pipe closes
        time.sleep(0.1)
    assert _segments() - before == set()


# ---- in-process: no hang, honest baselines, the sections' bookkeeping --------------------------------------------


def _engine(path):
    return LLMEngine(EngineConfig(model=str(path), kv_blocks=64))


def test_a_forward_that_raises_ends_the_measurement_with_the_engines_error(tiny_llama_path, monkeypatch):
    engine = _engine(tiny_llama_path)

    def broken(*args, **kwargs):
        raise RuntimeError("the kernel blew up")

    monkeypatch.setattr(engine.runner, "decoder", broken)
    t0 = time.monotonic()
    with pytest.raises(gpu_check_engine.RequestFailed, match="the kernel blew up"):
        gpu_check_engine.decode_tps(engine, 2, 8, 4, 200, Deadline.after(60, "test"))
    with pytest.raises(gpu_check_engine.RequestFailed, match="the kernel blew up"):
        gpu_check_engine.prefill_tps(engine, 2, 8, 200, 1, Deadline.after(60, "test"))
    with pytest.raises(gpu_check_engine.RequestFailed, match="the kernel blew up"):
        gpu_check_engine.engine_greedy(engine, [[1, 2, 3]], 4, Deadline.after(60, "test"))
    assert time.monotonic() - t0 < 10
    engine.check_no_leaks()  # the failed requests left nothing behind


def test_a_measurement_past_its_deadline_stops_and_leaves_the_engine_empty(tiny_llama_path):
    engine = _engine(tiny_llama_path)
    with pytest.raises(OutOfTime, match="decode section: out of time while prefilling a decode batch of 2"):
        gpu_check_engine.decode_tps(engine, 2, 8, 50, 200, Deadline(time.monotonic() - 1, "decode section"))
    engine.check_no_leaks()


def test_a_variant_whose_forward_fails_is_a_row_with_its_error(tiny_llama_path, monkeypatch):
    def broken(engine, deadline):
        raise gpu_check_engine.RequestFailed("request x failed while the smoke forward: boom")

    monkeypatch.setattr(gpu_check_engine, "smoke", broken)
    rows = gpu_check_engine.decode_variants(
        str(tiny_llama_path), "cpu", "float32", [("sdpa", False), ("flex", False)], [1], 8, 4, 200, 16 << 20,
        Deadline.after(60, "test"),
    )  # fmt: skip
    assert [r["error"] for r in rows] == ["RequestFailed: request x failed while the smoke forward: boom"] * 2


class SpyModel:
    """Records each ``generate`` call's shape (batch, max_new_tokens, cache) and where its criteria stop it."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def generate(self, ids, attention_mask, max_new_tokens, do_sample, stopping_criteria, **cache):
        stop = stopping_criteria[0]
        self.calls.append({"shape": (ids.shape[0], max_new_tokens, tuple(sorted(cache.items()))), "stop": stop.n})
        return ids


@pytest.mark.parametrize("compiled", [False, True])
def test_generate_baselines_are_warmed_on_every_shape_they_time(compiled):
    model = SpyModel()
    gpu_check_models.hf_decode_tps(model, 4, 16, 8, "cpu", 100, compiled, reps=2)
    shapes = {c["shape"] for c in model.calls}
    assert shapes == {(4, 8, (("cache_implementation", "static"),) if compiled else (("disable_compile", True),))}
    warm, timed = model.calls[:2], model.calls[2:]
    assert [c["stop"] for c in warm] == [8, 1] and [c["stop"] for c in timed] == [8, 1, 8, 1]


def test_the_stop_criterion_stops_after_n_new_tokens():
    stop = gpu_check_models._StopAfter(prompt_len=5, n=2)
    assert stop(torch.zeros(3, 6, dtype=torch.long), None).tolist() == [False] * 3
    assert stop(torch.zeros(3, 7, dtype=torch.long), None).tolist() == [True] * 3


def test_goals_take_the_faster_generate_and_name_it():
    primary = {
        "decode": [
            {"attention_backend": "auto", "cuda_graphs": True, "tokens_per_s": {"1": 300.0, "128": 9000.0}},
            {"attention_backend": "sdpa", "cuda_graphs": False, "tokens_per_s": {"1": 100.0, "128": 4000.0}},
        ],
        "transformers": {
            "generate_eager_tokens_per_s": {"1": 50.0, "128": 5000.0},
            "generate_compiled": {"tokens_per_s": {"1": 150.0}},  # its batch-128 figure never came (budget)
        },
    }
    goals = {g["goal"]: g for g in gpu_check.goals(primary, {"batches": [1, 32, 128]})}
    assert (goals["decode_b1_vs_generate"]["value"], goals["decode_b1_vs_generate"]["baseline"]) == (
        2.0,
        "generate compiled",
    )
    assert (goals["decode_b128_vs_generate"]["value"], goals["decode_b128_vs_generate"]["baseline"]) == (
        1.8,
        "generate eager",
    )
    assert goals["decode_b1_vs_eager"]["value"] == 3.0 and goals["decode_b1_vs_eager"]["passed"] is True
    assert goals["prefill_vs_forward"]["value"] is None and goals["prefill_vs_forward"]["passed"] is None


def test_the_verdict_is_ok_only_when_every_goal_passed_and_every_exact_check_held():
    """A part that failed or never ran makes the run's verdict fail, by name; a figure (bfloat16 top-1) is not judged."""

    def result(passed, exact):
        return {"goals": [{"goal": "a", "passed": True}, {"goal": "b", "passed": passed}], "exact": exact}

    held = {"float32_vs_generate": True, "prefill_decode_pair_bfloat16_top1": 0.97}
    assert gpu_check.verdict(result(True, held)) == {"ok": True, "failed": [], "unmeasured": []}
    assert gpu_check.verdict(result(False, held)) == {"ok": False, "failed": ["goals.b"], "unmeasured": []}
    missing = gpu_check.verdict(result(None, held | {"float32_vs_generate": None}))
    assert missing == {"ok": False, "failed": [], "unmeasured": ["goals.b", "exact.float32_vs_generate"]}
    broken = gpu_check.verdict(result(True, held | {"float32_vs_generate": False}) | {"aborted": "the hard limit"})
    assert broken["failed"] == ["exact.float32_vs_generate", "aborted"] and not broken["ok"]


def test_a_section_keeps_what_it_recorded_before_it_failed_and_the_file_follows(tmp_path):
    out = tmp_path / "run.json"
    run = gpu_check.Run(out, {"check": "gpu-check"}, Deadline.after(60, "the run"), gpu_check.TINY_SIZES)
    primary: dict = {}
    run.result["primary"] = primary

    def partial(deadline):
        primary["decode"] = [{"attention_backend": "auto", "cuda_graphs": True, "tokens_per_s": {"1": 5.0}}]
        raise OutOfTime("decode: out of time while decoding a batch of 4")

    run.section("decode", partial, primary)
    written = json.loads(out.read_text())
    assert written["primary"]["decode"][0]["tokens_per_s"] == {"1": 5.0}  # the finished row stays
    assert written["primary"]["decode_error"] == "out of time: decode: out of time while decoding a batch of 4"
    run.section("memory", lambda d: {"figure": 1}, primary)
    assert json.loads(out.read_text())["primary"]["memory"]["figure"] == 1
    run.deadline = Deadline(time.monotonic() - 1, "the run")
    run.section("prefill", lambda d: {"never": True}, primary)
    assert json.loads(out.read_text())["primary"]["prefill"] == {"error": "skipped: the run's time budget is spent"}


def test_other_backends_only_where_they_can_run(monkeypatch):
    present: set[str] = set()
    monkeypatch.setattr(
        gpu_check.importlib.util, "find_spec", lambda name: SimpleNamespace() if name in present else None
    )
    variants, skipped = gpu_check.other_variants("cuda", quick=True)
    assert variants == [("flex", False), ("flex", True)] and "not importable" in skipped["flashinfer"]
    present.add("flashinfer")
    variants, skipped = gpu_check.other_variants("cuda", quick=True)
    assert ("flashinfer", False) not in variants and "would JIT-compile" in skipped["flashinfer"]
    variants, _ = gpu_check.other_variants("cuda", quick=False)  # the full run may spend the minutes
    assert variants[-2:] == [("flashinfer", False), ("flashinfer", True)] and variants[0] == ("sdpa", True)
    present.add("flashinfer_cubin")
    variants, skipped = gpu_check.other_variants("cuda", quick=True)
    assert ("flashinfer", True) in variants and "flashinfer" not in skipped
