"""NCCL's process-wide settings for pdserve's pair groups, and the one place a process sets them: its start.

Each pair group bounds and aborts its own ops (transfer/pairgroup.py), so none of torch's NCCL machinery (watchdog,
dump on timeout, heartbeat monitor, error propagation through the store) may take the process down after a pair's
timeout. ProcessGroupNCCL reads them from the C++ environment, which other threads read too, so they go into a worker's
environment before it starts (docs/transfer.md, "nccl / gloo pair groups"); a group built without them logs a warning.
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
