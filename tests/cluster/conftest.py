from __future__ import annotations

import pytest

from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free
from tests.helpers.openai_api import TOOL_TEMPLATE, Clusters, model_folder


@pytest.fixture
def serve(tiny_llama_path):
    """``serve(**sections)``: an in-process cluster on the tiny model (the real router, API, workers and transfer, as
    threads); at teardown every block must be free, no request held, and no stream left at the router."""
    from cluster.run.launch import start_serving

    handles = []

    def start(**sections):
        handle = start_serving(tiny_cluster_config(tiny_llama_path, **sections), in_process=True)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        try:
            wait_all_kv_free(handle.base_url, api_key=handle.config.router.api_key)
            assert not handle.router.flows
        finally:
            handle.stop()


@pytest.fixture(scope="module")
def clusters():
    """In-process clusters shared by one test module (one per model folder and mode), leak-checked at its end."""
    pool = Clusters()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def tool_model_folder(tiny_llama_path, tmp_path_factory):
    """The tiny model with a chat template that renders tools, tool calls and names (Qwen3's shape)."""
    return model_folder(tiny_llama_path, tmp_path_factory.mktemp("tool-template") / "model", TOOL_TEMPLATE)
