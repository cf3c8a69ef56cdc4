"""start_serving leaves nothing behind when it cannot serve: its HTTP port taken, the workers it started stop."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from cluster.run.launch import start_serving
from tests.helpers.cluster import tiny_cluster_config


def test_a_taken_port_stops_the_workers_already_started(tiny_llama_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        config = tiny_cluster_config(tiny_llama_path, router={"port": taken.getsockname()[1]})
        with pytest.raises(OSError):
            start_serving(config, in_process=True)
        deadline = time.monotonic() + 10
        while any(t.name.endswith("-loop") for t in threading.enumerate()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [t.name for t in threading.enumerate() if t.name.endswith("-loop")]
    finally:
        taken.close()
