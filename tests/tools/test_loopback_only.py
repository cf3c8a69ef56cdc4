"""tools/loopback-only, which `make test` runs the suite under: the command sees the loopback interface and the
namespace's own veth pair (both ends inside, no route anywhere), nothing of the machine's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "loopback-only"


def test_the_command_runs_with_only_loopback_or_says_why_not():
    probe = "import os, socket; print(os.environ.get('PDSERVE_LOOPBACK_ONLY'), [n for _, n in socket.if_nameindex()])"
    run = subprocess.run([str(SCRIPT), sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    if "cannot make a network namespace" in run.stderr:
        pytest.skip("no network namespace can be made on this machine")
    flag, names = run.stdout.split(maxsplit=1)
    assert flag == "1" and set(eval_names(names)) <= {"lo", "pdserve0", "pdserve1"} and "lo" in names


def test_the_exit_status_is_the_commands():
    assert subprocess.run([str(SCRIPT), sys.executable, "-c", "raise SystemExit(3)"], timeout=60).returncode == 3


@pytest.mark.skipif(os.environ.get("PDSERVE_LOOPBACK_ONLY") != "1", reason="the suite is not running under it")
def eval_names(text: str) -> list[str]:
    return [name.strip(" '") for name in text.strip().strip("[]").split(",")]


def test_this_suite_sees_no_interface_but_loopback_and_its_own_veth_pair():
    assert {name for _, name in socket.if_nameindex()} <= {"lo", "pdserve0", "pdserve1"}
    routes = Path("/proc/net/route").read_text().splitlines()[1:]
    assert all(line.split()[1] != "00000000" for line in routes)  # no default route: nothing beyond the namespace
