from __future__ import annotations

import pytest

from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free


@pytest.fixture
def serve(tiny_llama_path):
    """``serve(**sections)``: an in-process cluster on the tiny model (the real router, API, workers and transfer, as
    threads); at teardown every block must be free, no request held, and no stream left at the router."""
    from cluster.launch import start_serving

    handles = []

    def start(**sections):
        handle = start_serving(tiny_cluster_config(tiny_llama_path, **sections), in_process=True)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        try:
            wait_all_kv_free(handle.base_url, api_key=handle.config.router.api_key)
            assert not handle.router.streams
        finally:
            handle.stop()
