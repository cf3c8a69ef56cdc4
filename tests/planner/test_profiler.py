"""``pdserve profile``: the least-squares fits, and a quick profile of the tiny model through the command line.

The profile is measured once per module (it takes seconds on the tiny model) through ``pdserve profile --quick``;
the tests read the file it wrote, as ``pdserve plan`` would. Wall time is never asserted: only what the timings say
relative to each other (a 16-token prefill is faster than one of hundreds) and how well the fits reproduce them.
"""

from __future__ import annotations

import datetime
import json
import os

import pytest
import yaml

from cli.main import main
from planner.fit import fit_points, quality
from planner.profile_model import Profile
from planner.profiler import DECODE_FEATURES, PREFILL_FEATURES, geometric, profile_cluster
from tests.helpers.cluster import tiny_cluster_config
from transfer.shm_ring import PREFIX, SHM_DIR

pytestmark = pytest.mark.timeout(300)

# How far a fit may be from the points it was fitted to (mean relative error). The tiny model's steps take a
# millisecond or two, so scheduling noise on a shared 2-core box is a large share of each one; the default model's
# profile fits far tighter (its notes say how tight).
MEAN_TOLERANCE = 0.5


def _segments() -> set[str]:
    return {name for name in os.listdir(SHM_DIR) if name.startswith(PREFIX)}


@pytest.fixture(scope="module")
def profiled(tiny_llama_path, tmp_path_factory):
    """(the config, the profile file written by ``pdserve profile --quick``, shm segments it left behind)."""
    folder = tmp_path_factory.mktemp("profile")
    decode = {"replicas": 1, "torch_threads": 1, "kv_blocks": 256, "max_num_seqs": 32}
    config = tiny_cluster_config(
        tiny_llama_path, pools={"prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96}, "decode": decode}
    )
    config_path = folder / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    out = folder / "profile.json"
    before = _segments()
    status = main(["profile", "--config", str(config_path), "--out", str(out), "--quick", "--no-progress"])
    assert status == 0
    return config, out, _segments() - before


def test_the_cli_writes_a_profile_that_loads(profiled, tiny_llama_path) -> None:
    config, out, leftover = profiled
    profile = Profile.load(out)
    model = json.loads((tiny_llama_path / "config.json").read_text())
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    assert profile.model == config.model.name and profile.dtype == config.served_dtype == "float32"
    assert profile.device == "cpu" and profile.backend == "shm"  # auto, two workers on one node
    assert profile.kv_bytes_per_token == 2 * model["num_hidden_layers"] * model["num_key_value_heads"] * head_dim * 4
    assert profile.block_size == config.transfer.block_size
    assert profile.max_batch_tokens == config.pools.prefill.max_batch_tokens
    assert profile.max_num_seqs == config.pools.decode.max_num_seqs
    assert profile.tensor_parallel_size == 1 and profile.num_kv_heads == model["num_key_value_heads"]
    assert profile.kv_blocks == 256  # the decode worker's, as its config sets them
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(profile.date)
    assert datetime.timedelta(0) <= age < datetime.timedelta(minutes=10)
    assert leftover == set(), "the transfer measurement left a shared-memory segment behind"


def test_every_kind_of_point_is_measured(profiled) -> None:
    _, out, _ = profiled
    profile = Profile.load(out)
    assert {p.context for p in profile.prefill_points} > {0}  # first chunks and chunks after a cached context
    assert len({p.tokens for p in profile.prefill_points if p.context == 0}) >= 3
    assert len({p.batch for p in profile.decode_points}) >= 3
    assert max(p.batch for p in profile.decode_points) <= profile.max_num_seqs
    assert len({p.num_bytes for p in profile.transfer_points}) >= 2
    every = [*profile.prefill_points, *profile.decode_points, *profile.transfer_points]
    assert all(p.seconds > 0 for p in every)
    sizes = [p.num_bytes for p in profile.transfer_points]
    assert all(size % (profile.kv_bytes_per_token * profile.block_size) == 0 for size in sizes)  # whole blocks


def test_times_grow_with_tokens_and_batch(profiled) -> None:
    _, out, _ = profiled
    profile = Profile.load(out)
    first = sorted((p for p in profile.prefill_points if p.context == 0), key=lambda p: p.tokens)
    assert first[-1].tokens >= 16 * first[0].tokens and first[-1].seconds > first[0].seconds
    assert profile.prefill_s(first[-1].tokens) > profile.prefill_s(first[0].tokens)
    decode = sorted(profile.decode_points, key=lambda p: p.batch * p.context_tokens)
    assert decode[-1].seconds > decode[0].seconds  # the largest batch of the longest context against one request
    smallest, largest = decode[0], decode[-1]
    assert profile.decode_step_s(largest.batch, largest.context_tokens) > profile.decode_step_s(
        smallest.batch, smallest.context_tokens
    )
    transfers = sorted(profile.transfer_points, key=lambda p: p.num_bytes)
    assert profile.transfer_s(transfers[-1].num_bytes) >= profile.transfer_s(transfers[0].num_bytes)


def test_the_fits_reproduce_the_measured_points(profiled) -> None:
    _, out, _ = profiled
    profile = Profile.load(out)
    assert profile.prefill_fit is not None and profile.decode_fit is not None and profile.transfer_fit is not None
    checks = [
        (
            profile.prefill_fit,
            [{"tokens": p.tokens, "context": p.context} for p in profile.prefill_points],
            [p.seconds for p in profile.prefill_points],
        ),
        (
            profile.decode_fit,
            [{"batch": p.batch, "context_tokens": p.context_tokens} for p in profile.decode_points],
            [p.seconds for p in profile.decode_points],
        ),
        (
            profile.transfer_fit,
            [{"num_bytes": p.num_bytes} for p in profile.transfer_points],
            [p.seconds for p in profile.transfer_points],
        ),
    ]
    for fit, rows, seconds in checks:
        assert all(c >= 0 for c in fit.coefficients), fit
        assert quality(fit, rows, seconds).mean_rel_error <= MEAN_TOLERANCE, (fit, rows, seconds)
    assert "prefill fit:" in profile.notes and "decode fit:" in profile.notes and "transfer fit:" in profile.notes


def test_a_fit_recovers_known_coefficients() -> None:
    rows = [{"tokens": t, "context": c} for t in (16, 64, 256, 1024) for c in (0, 512)]
    truth = {"1": 0.02, "tokens": 3e-4, "tokens*context": 1e-7, "tokens*tokens": 5e-8}
    seconds = [
        truth["1"]
        + truth["tokens"] * r["tokens"]
        + truth["tokens*context"] * r["tokens"] * r["context"]
        + truth["tokens*tokens"] * r["tokens"] ** 2
        for r in rows
    ]
    fit, fitted = fit_points(PREFILL_FEATURES, rows, seconds)
    assert fit.coefficients == pytest.approx([truth[name] for name in PREFILL_FEATURES], rel=1e-6)
    assert fitted.max_rel_error < 1e-9 and fitted.num_points == len(rows)


def test_a_negative_coefficient_is_clipped_and_the_rest_refitted() -> None:
    """Times that flatten with the batch would give ``batch`` a negative coefficient in an unconstrained fit; the
    fit drops that feature instead, so a larger batch never predicts a shorter step."""
    rows = [{"batch": b, "context_tokens": c} for b in (1, 2, 4, 8) for c in (100, 1000, 4000)]
    seconds = [0.05 - 0.001 * r["batch"] + 2e-5 * r["context_tokens"] for r in rows]  # batch: -0.001 per request
    fit, _ = fit_points(DECODE_FEATURES, rows, seconds)
    assert all(c >= 0 for c in fit.coefficients)
    assert fit.coefficients[DECODE_FEATURES.index("batch")] == 0.0
    assert fit.coefficients[DECODE_FEATURES.index("context_tokens")] > 0
    for context in (100, 1000, 4000):  # a larger batch never predicts a shorter step
        predictions = [fit(batch=b, context_tokens=context) for b in (1, 2, 4, 8)]
        assert predictions == sorted(predictions)


def test_geometric_grids() -> None:
    assert geometric(1, 64, 7) == [1, 2, 4, 8, 16, 32, 64]
    assert geometric(16, 2048, 5)[0] == 16 and geometric(16, 2048, 5)[-1] == 2048
    assert geometric(8, 8, 4) == [8]


def test_pools_of_different_degrees_are_refused_with_the_field(tiny_llama_path) -> None:
    config = tiny_cluster_config(tiny_llama_path, pools={"decode": {"replicas": 1, "tensor_parallel_size": 2}})
    with pytest.raises(
        ValueError,
        match=r"pools.<pool>.tensor_parallel_size: the pools ask for \(tensor, expert\) degrees \[\(1, 1\), \(2, 1\)\]",
    ):
        profile_cluster(config, quick=True, progress=False)


def test_a_degree_the_model_cannot_split_is_refused_with_the_flag(tiny_llama_path) -> None:
    config = tiny_cluster_config(tiny_llama_path)
    with pytest.raises(ValueError, match="--tensor-parallel-size: tensor_parallel_size 3 does not divide"):
        profile_cluster(config, quick=True, progress=False, tensor_parallel_size=3)


@pytest.mark.e2e  # two ranks profiled: `make test-e2e`
def test_a_profile_at_degree_two_runs_two_ranks_and_moves_every_head(profiled, tmp_path) -> None:
    """Each pool's engine as two local processes: the points, fits and KV figures of a degree-2 worker; the transfer
    carries every KV head (as the hand-off does) into rank 0, which hands each piece on to rank 1."""
    config, one_path, _ = profiled
    one = Profile.load(one_path)
    out = tmp_path / "tp2.json"
    before = _segments()
    config_path = one_path.parent / "cluster.yaml"
    args = ["profile", "--config", str(config_path), "--out", str(out), "--quick", "--no-progress"]
    assert main([*args, "--tensor-parallel-size", "2"]) == 0
    two = Profile.load(out)
    assert _segments() - before == set()
    assert two.tensor_parallel_size == 2 and one.tensor_parallel_size == 1
    assert "tensor_parallel_size 2, expert_parallel_size 1 (ranks as local processes)" in two.notes
    assert two.kv_bytes_per_token == one.kv_bytes_per_token and two.num_kv_heads == one.num_kv_heads
    assert two.kv_blocks == one.kv_blocks == 256  # the config's kv_blocks, on every rank (each with half the heads)
    assert {p.num_bytes for p in two.transfer_points} and two.backend == one.backend == "shm"
    assert len(two.prefill_points) == len(one.prefill_points) and len(two.decode_points) >= 3
    assert two.prefill_fit is not None and two.decode_fit is not None and two.transfer_fit is not None


def test_a_profile_takes_an_expert_degree_for_both_pools(tmp_path) -> None:
    """``pdserve profile --tensor-parallel-size 2 --expert-parallel-size 2`` profiles both pools' workers at (2, 2),
    and a degree the model cannot take names the flag (a dense model has no experts to split)."""
    from engine.tiny_model import build_tiny_model
    from planner.profiler import pool_specs

    mixtral = build_tiny_model(tmp_path / "mixtral", arch="mixtral")
    prefill, decode = pool_specs(tiny_cluster_config(mixtral), 2, 2)
    assert {(s.engine.tensor_parallel_size, s.engine.expert_parallel_size) for s in (prefill, decode)} == {(2, 2)}
    dense = build_tiny_model(tmp_path / "llama", arch="llama")
    with pytest.raises(ValueError, match="--expert-parallel-size: expert_parallel_size 2: .* no routed experts"):
        pool_specs(tiny_cluster_config(dense), 2, 2)
