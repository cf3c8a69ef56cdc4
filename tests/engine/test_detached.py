"""A detached child (engine/detached.py, the background compile's process): it outlives the process that started it,
is nobody's child but init's, sits in a session of its own (a Ctrl-C does not reach it) and reports its exit status;
one that is killed reports ``DIED``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from engine.detached import DIED, start_detached

REPORT = "from engine.detached import report_exit; import time; time.sleep({sleep}); report_exit({status})"


def _child(sleep: float, status: int) -> list[str]:
    return [sys.executable, "-c", REPORT.format(sleep=sleep, status=status)]


def test_its_status_comes_back_and_it_is_not_our_child():
    child = start_detached(_child(0.5, 3), os.environ)
    assert child.poll() is None
    assert os.getsid(child.pid) != os.getsid(0)  # a session of its own
    with open(f"/proc/{child.pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) != os.getpid()  # its parent is not this process
    assert child.wait(timeout=30) == 3 and child.poll() == 3


def test_a_killed_child_reports_died():
    child = start_detached(_child(60, 0), os.environ)
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait(timeout=30) == DIED


def test_it_finishes_after_the_process_that_started_it_exited(tmp_path):
    released, done = tmp_path / "released", tmp_path / "done"
    writer = (
        "import pathlib, time\n"
        f"while not pathlib.Path({str(released)!r}).exists(): time.sleep(0.05)\n"
        f"pathlib.Path({str(done)!r}).write_text('finished')"
    )
    starter = f"import os, sys; from engine.detached import start_detached; print(start_detached({[sys.executable, '-c', writer]!r}, os.environ).pid)"
    # its stdout only: the child shares its stderr, which would hold a capture open until the child ends
    started = subprocess.run([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True, timeout=60, check=True)
    pid = int(started.stdout)
    assert os.path.exists(f"/proc/{pid}") and not done.exists()
    released.touch()  # the starter has exited: now the child finishes its work
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:  # it ends, reaped by init
        time.sleep(0.05)
    assert done.read_text() == "finished" and not os.path.exists(f"/proc/{pid}")
