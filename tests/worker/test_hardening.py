"""A worker closed to the other processes of its user (worker/hardening.py): once it is not dumpable, another process
of the same user can no longer open its descriptors (the KV cache's memfd) or read its environment through /proc.

Run as root, both processes drop to uid 65534 first (root's CAP_SYS_PTRACE passes every such check)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from worker.hardening import ALLOW_ENV, close_to_other_processes, dumpable

pytestmark = pytest.mark.timeout(60)

AS_OTHER_PROCESS_OF_USER = """
import ctypes, os, sys
from worker.hardening import PR_SET_DUMPABLE, close_to_other_processes  # imported first: uid 65534 may not read them
if os.getuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
"""

WORKER = (
    AS_OTHER_PROCESS_OF_USER
    + """
ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a changed uid left it not dumpable: start as a plain process
fd = os.memfd_create("pdserve-kvc-test")
print(os.getpid(), fd, flush=True)
sys.stdin.readline()
print(close_to_other_processes(), flush=True)
sys.stdin.readline()
"""
)

STRANGER = (
    AS_OTHER_PROCESS_OF_USER
    + """
pid, fd = sys.argv[1:3]
for path in (f"/proc/{pid}/fd/{fd}", f"/proc/{pid}/environ"):
    try:
        os.close(os.open(path, os.O_RDONLY))
        print("opened", path)
    except PermissionError:
        print("refused", path)
"""
)


def _stranger(pid: int, fd: int) -> list[str]:
    run = subprocess.run(
        [sys.executable, "-c", STRANGER, str(pid), str(fd)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    return [line.split()[0] for line in run.stdout.splitlines()]


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_DUMPABLE and /proc are Linux's")
def test_another_process_of_the_user_cannot_open_a_closed_workers_descriptors() -> None:
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    worker = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WORKER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONPATH": os.getcwd()},
    )
    assert worker.stdin is not None and worker.stdout is not None
    try:
        pid, fd = map(int, worker.stdout.readline().split())
        assert _stranger(pid, fd) == ["opened", "opened"]  # a plain process: its cache is anyone's of the user
        worker.stdin.write("close\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "True"
        assert _stranger(pid, fd) == ["refused", "refused"]
    finally:
        worker.stdin.close()
        worker.wait(timeout=10)


def test_the_debugging_switch_leaves_a_worker_dumpable(monkeypatch) -> None:
    monkeypatch.setenv(ALLOW_ENV, "1")
    assert close_to_other_processes() is False
    assert dumpable()  # (this test's process: the switch was read before anything changed)
