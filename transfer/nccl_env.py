"""NCCL's process-wide settings for pdserve's pair groups, and the one place a process sets them: its start.

Each KV pair group bounds and aborts its own ops (transfer/pairgroup.py), so none of torch's NCCL machinery may take
the process down after a pair's timeout:
- ``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``: the watchdog does not tear the process down on a timed-out op;
- ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``: a timed-out op does not broadcast the dump signal (through the store the
  receiver shares with all its pairs) that makes the first group's heartbeat monitor dump and then abort the process;
- ``TORCH_NCCL_ENABLE_MONITORING=0``: no heartbeat monitor thread, whose stuck-watchdog check kills the process;
- ``TORCH_NCCL_PROPAGATE_ERROR=0``: one pair's error is not sent to the peer's other groups through the store.

ProcessGroupNCCL reads them when a group is built, from the C++ environment, which other threads (NCCL's, CUDA's,
Ray's) read too; changing ``os.environ`` while they run can race glibc's ``setenv``. So they go into a worker's
environment before it starts: Ray actors get them in their ``runtime_env`` (cluster/pools.py), a process pdserve
spawns itself calls ``set_at_process_start`` first thing. A pair group built without them logs a warning.
"""

from __future__ import annotations

import os
import threading
from collections.abc import MutableMapping

NCCL_PROCESS_ENV: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_PROPAGATE_ERROR": "0",
}


def missing(environ: MutableMapping[str, str] | None = None) -> dict[str, str | None]:
    """The settings ``environ`` (default: this process's) lacks or has otherwise: name -> what it has (None: unset)."""
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name, value in NCCL_PROCESS_ENV.items() if env.get(name) != value}


def set_at_process_start(environ: MutableMapping[str, str] | None = None) -> None:
    """Put the settings into this process's environment; only while it runs one thread (its start)."""
    if threading.active_count() > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread())
        raise RuntimeError(
            f"NCCL settings must be set before any other thread runs (running: {', '.join(names)[:200]}); "
            "pass them in the process's environment instead"
        )
    (os.environ if environ is None else environ).update(NCCL_PROCESS_ENV)
