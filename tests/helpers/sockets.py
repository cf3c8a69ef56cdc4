"""Which sockets a process tree listens on: the process, its descendants and every process of its session."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str  # the process's name, as `ss -p` shows it
    host: str
    port: int

    @property
    def loopback(self) -> bool:
        address = ipaddress.ip_address(self.host.split("%")[0])
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_loopback


def session_processes(root_pid: int) -> list[psutil.Process]:
    """``root_pid``, its descendants, and the processes of its session (Ray daemonizes some of its own)."""
    root = psutil.Process(root_pid)
    found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    sid = os.getsid(root_pid)
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid:
                found.setdefault(proc.pid, proc)
        except (ProcessLookupError, PermissionError):
            continue
    return list(found.values())


def listening_sockets(root_pid: int) -> list[Listener]:
    listeners = []
    for proc in session_processes(root_pid):
        try:
            name = proc.name()
            connections = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for conn in connections:
            if conn.status == psutil.CONN_LISTEN:
                listeners.append(Listener(proc.pid, name, conn.laddr.ip, conn.laddr.port))
    return listeners
