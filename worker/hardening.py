"""A worker's process closed to the other processes of its user: not dumpable, so its /proc/<pid>/fd, mem and environ,
ptrace and process_vm_readv need CAP_SYS_PTRACE, and no core file carries the cluster secret or the KV cache
(docs/architecture.md, "What a node trusts"). Same-node senders get the KV cache over an authenticated Unix socket
instead (transfer/fd_pass.py). ``PDSERVE_DUMPABLE=1`` leaves a worker dumpable, for a debugger or py-spy."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

log = logging.getLogger(__name__)

PR_GET_DUMPABLE, PR_SET_DUMPABLE = 3, 4
ALLOW_ENV = "PDSERVE_DUMPABLE"


def _prctl(option: int, value: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    result = int(libc.prctl(option, value, 0, 0, 0))
    if result < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return result


def dumpable() -> bool:
    """Whether other processes of this user can read this one's memory and descriptors (True off Linux)."""
    return sys.platform != "linux" or _prctl(PR_GET_DUMPABLE) != 0


def close_to_other_processes() -> bool:
    """Makes this process not dumpable, unless ``PDSERVE_DUMPABLE=1``; whether it is closed now. Only a process that
    is a worker and nothing else calls it (a Ray actor): an in-process cluster leaves its host process as it is."""
    if os.environ.get(ALLOW_ENV) == "1":
        log.warning("%s=1: this worker's memory and descriptors stay open to the user's other processes", ALLOW_ENV)
        return False
    if sys.platform != "linux":
        return False
    try:
        _prctl(PR_SET_DUMPABLE, 0)
    except OSError as e:
        log.warning("this worker stays dumpable (prctl refused: %s)", e)
        return False
    return True
