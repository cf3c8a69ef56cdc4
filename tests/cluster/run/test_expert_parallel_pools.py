"""Expert parallelism behind the real router and API: ``pools.<pool>.expert_parallel_size`` splits a mixture of
experts' routed experts over the worker's tensor-parallel ranks, and each phase may take its own layout (the KV moves
by heads whatever the experts' layout). Token-exact against one rank within 1e-4 per chosen token's logprob, and the
worker's expert traffic in ``/metrics``.
"""

from __future__ import annotations

import pytest

from cluster.config import ConfigError
from engine.tiny_model import build_tiny_model
from tests.cluster.run.test_tensor_parallel_pools import LOGPROB_TOLERANCE, PROMPTS, _complete, _same_tokens_gap
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_all_kv_free, wait_until


@pytest.fixture(scope="module")
def tiny_moe_paths(tmp_path_factory):
    return {
        arch: build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
        for arch in ("mixtral", "deepseek_v3", "gpt_oss")
    }


def _pool(tp: int, ep: int) -> dict:
    return {"replicas": 1, "torch_threads": 1, "kv_blocks": 96, "tensor_parallel_size": tp, "expert_parallel_size": ep}


def _serve(config) -> tuple[dict, dict[str, float | None]]:
    """Each prompt's text and logprobs, and each pool's expert load imbalance as ``/metrics`` shows it."""
    from cluster.run.launch import start_serving

    handle = start_serving(config, in_process=True)
    try:
        outputs = {p: _complete(handle, p) for p in PROMPTS}
        wait_all_kv_free(handle.base_url)
        assert not handle.router.flows
        imbalance: dict[str, float | None] = {}
        for record in handle.pools.workers:
            name, pool = record.name, record.name.split("-")[0]

            def shown(name: str = name, pool: str = pool) -> float | None:
                return metric_value(handle.base_url, "pdserve_expert_load_imbalance", worker=name, pool=pool)

            if getattr(config.pools, pool).expert_parallel_size > 1:
                wait_until(lambda: shown() is not None, 10)  # the first heartbeat after the requests
            imbalance[pool] = shown()
    finally:
        handle.stop()
    return outputs, imbalance


@pytest.mark.parametrize(
    ("arch", "prefill", "decode"),
    [
        ("mixtral", (2, 2), (1, 1)),  # (tensor, expert) degrees
        # latent attention: q and kv_b_proj cut by heads, every rank caching the whole latent row, which the one
        # prefill rank sends once to each decode rank
        ("deepseek_v3", (1, 1), (2, 2)),
        pytest.param("deepseek_v3", (2, 2), (2, 1), marks=pytest.mark.e2e),  # the latent from rank 0 only
        # the experts split alone: each decode rank holds every head, so each gets all of them (from the rank of the
        # prefill worker that holds them first); a prefill worker whose ranks all hold every head sends from rank 0
        ("mixtral", (2, 2), (1, 2)),
        pytest.param("gpt_oss", (1, 2), (1, 2), marks=pytest.mark.e2e),
        pytest.param("mixtral", (1, 2), (2, 2), marks=pytest.mark.e2e),
    ],
)
def test_each_phase_takes_its_own_layout_and_serves_what_one_rank_does(tiny_moe_paths, arch, prefill, decode):
    model = tiny_moe_paths[arch]
    one, _ = _serve(
        tiny_cluster_config(model, mode="colocated", pools={"prefill": {"replicas": 0}, "decode": _pool(1, 1)})
    )
    config = tiny_cluster_config(
        model,
        pools={"prefill": _pool(*prefill), "decode": _pool(*decode)},
        transfer={"backend": "zmq", "deadline_s": 20, "lease_s": 20},
        router={"port": 0, "local_prefill_max_tokens": 0},  # every prompt through the prefill worker
    )
    split, imbalance = _serve(config)
    gap = _same_tokens_gap(one, split)
    print(f"{arch}: prefill {prefill} -> decode {decode}: largest logprob gap {gap:.3g}; imbalance {imbalance}")
    assert gap < LOGPROB_TOLERANCE
    for pool, (_, experts) in (("prefill", prefill), ("decode", decode)):
        if experts > 1:  # the busiest rank's pairs over the mean
            assert imbalance[pool] is not None and imbalance[pool] >= 1.0
        else:
            assert imbalance[pool] is None  # whole experts: the gauge is not shown


def test_an_expert_degree_the_model_cannot_take_is_a_config_error(tiny_moe_paths, tiny_llama_path):
    from cluster.run.launch import start_serving

    with pytest.raises(ValueError, match="expert_parallel_size 4: .* 1, tensor_parallel_size"):
        tiny_cluster_config(tiny_moe_paths["mixtral"], pools={"decode": _pool(2, 4)})
    with pytest.raises(ConfigError, match=r"pools\.decode\.expert_parallel_size: .*no routed experts"):
        start_serving(tiny_cluster_config(tiny_llama_path, pools={"decode": _pool(1, 2)}), in_process=True)


def test_a_stream_moves_exactly_between_workers_whose_ranks_each_hold_every_head(tiny_moe_paths):
    """Decode workers with the experts split alone (tensor 1, expert 2): the source's rank 0 sends every head to each
    of the target's ranks (its KV address says they hold them whole); the client's text is the undisturbed run's."""
    import httpx

    from cluster.run.launch import start_serving
    from tests.cluster.test_migration_cluster import PROMPTS as MOVE_PROMPTS
    from tests.cluster.test_migration_cluster import _reference, _stream

    config = tiny_cluster_config(
        tiny_moe_paths["mixtral"],
        pools={"prefill": _pool(1, 1), "decode": _pool(1, 2) | {"replicas": 2}},
        transfer={"backend": "zmq", "deadline_s": 20, "lease_s": 20},
    )
    handle = start_serving(config, in_process=True)
    try:
        expected = _reference(handle, MOVE_PROMPTS[2])

        def move() -> None:
            [flow] = list(dict.fromkeys(handle.router.core.flows.values()))
            body = {"request_id": flow.rid}
            httpx.post(f"{handle.base_url}/admin/migrate", json=body, headers=handle.admin_headers, timeout=10)

        text, last = _stream(handle, MOVE_PROMPTS[2], after_chunks=5, action=move)
        assert text == expected["choices"][0]["text"]
        assert last["timing"]["migrations"] == 1
        assert metric_value(handle.base_url, "pdserve_migrations_total", reason="admin", result="moved") == 1
        wait_all_kv_free(handle.base_url)
        assert not handle.router.flows
    finally:
        handle.stop()
