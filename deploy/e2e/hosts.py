"""Separate hosts on one machine for pdserve's multi-host run (``make cluster-e2e``): Linux namespaces, as root.

Each host is a network namespace on a private bridge (its own address in ``SUBNET``), entered through a mount, UTS
and PID namespace of its own (its hostname, its process table, and private /tmp, /dev/shm and ~/.ray: Ray's
session files and ``ray stop``, shared-memory KV and Ray's token do not cross hosts), where sshd runs with a key
made here. The project's folder and venv are the one filesystem every host sees, as a shared home would be. The machine's own namespace reaches every host over the
bridge (``BRIDGE_IP``), as a client would.

    python deploy/e2e/hosts.py up | down | status

``down`` ends every process in the hosts' namespaces (all started through their sshd, by this script's runs), removes
the namespaces, the bridge and the state folder; it is safe to run at any time, also after a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STATE = Path("/var/lib/pdserve-e2e")  # key, sshd config, token, each host's private /tmp and ~/.ray
SUBNET = "10.213.7"  # a /24 no other part of this machine uses; the script owns it while it runs
BRIDGE = "pdse-br0"
BRIDGE_IP = f"{SUBNET}.1"
KEY = STATE / "id_ed25519"
TOKEN = STATE / "auth_token"  # Ray's cluster token (RAY_AUTH_MODE=token on every node)
SSH_TIMEOUT_S = 20


@dataclass(frozen=True)
class Host:
    name: str
    ip: str
    cpus: int  # what its Ray node offers (/tmp/pdserve-host-cpus, read by the cluster YAML's start commands)

    @property
    def netns(self) -> str:
        return f"pdse-{self.name}"

    @property
    def veth(self) -> str:
        return f"pdse-v{self.name}"  # the bridge's end of its link (tc netem and partitions act here)

    @property
    def home(self) -> Path:
        return STATE / self.name


# the head runs Ray's head and pdserve's router (0 CPUs for Ray: no worker lands there); w1 and w2 offer one CPU, so
# each holds one pdserve worker (each takes one): prefill and decode land on different hosts. A third worker needs
# the spare host w3, which `ray up` leaves to the autoscaler; it offers two, so a fourth joins the third there (a
# prefill and a decode worker on one host: KV through shared memory)
HOSTS = [
    Host("head", f"{SUBNET}.10", 0),
    Host("w1", f"{SUBNET}.11", 1),
    Host("w2", f"{SUBNET}.12", 1),
    Host("w3", f"{SUBNET}.13", 2),
]
BY_NAME = {h.name: h for h in HOSTS}


def run(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=timeout)


def ensure_packages() -> None:
    """sshd, rsync (``ray up`` copies files with it) and iptables (faults) from the distribution's packages."""
    wanted = (("openssh-server", "/usr/sbin/sshd"), ("rsync", "rsync"), ("iptables", "iptables"))
    missing = [p for p, binary in wanted if not shutil.which(binary)]
    if missing:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, env=env, timeout=600)


def up() -> None:
    if os.geteuid() != 0:
        sys.exit("hosts.py needs root (network and mount namespaces)")
    down()  # whatever a killed run left
    ensure_packages()
    STATE.mkdir(mode=0o700, parents=True)
    run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(KEY))
    run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(STATE / "host_key"))
    (STATE / "authorized_keys").write_text((STATE / "id_ed25519.pub").read_text())
    TOKEN.write_text(os.urandom(32).hex())  # Ray's own format: 256 bits in hex
    TOKEN.chmod(0o600)
    (STATE / "sshd_config").write_text(
        "\n".join(
            [
                f"HostKey {STATE / 'host_key'}",
                f"AuthorizedKeysFile {STATE / 'authorized_keys'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "PrintMotd no",
                "MaxStartups 100",
                "MaxSessions 100",
                "Subsystem sftp internal-sftp",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    Path("/root/.ray").mkdir(exist_ok=True)  # the mount point of each host's own ~/.ray
    run("ip", "link", "add", BRIDGE, "type", "bridge")
    run("ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
    run("ip", "link", "set", BRIDGE, "up")
    for host in HOSTS:
        _host_up(host)
    for host in HOSTS:
        _wait_ssh(host)


def _host_up(host: Host) -> None:
    run("ip", "netns", "add", host.netns)
    run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
    run("ip", "link", "set", host.veth, "master", BRIDGE, "up")
    run("ip", "-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
    run("ip", "-n", host.netns, "link", "set", "eth0", "up")
    run("ip", "-n", host.netns, "link", "set", "lo", "up")
    for folder in ("tmp", "dot-ray"):
        (host.home / folder).mkdir(parents=True)
    (host.home / "tmp").chmod(0o1777)
    (host.home / "tmp" / "pdserve-host-cpus").write_text(str(host.cpus))
    shutil.copy(TOKEN, host.home / "dot-ray" / "auth_token")
    script = " && ".join(
        [
            f"hostname {host.netns}",
            f"mount --bind {host.home / 'tmp'} /tmp",
            "mount -t tmpfs -o mode=1777,size=4g tmpfs /dev/shm",
            f"mount --bind {host.home / 'dot-ray'} /root/.ray",
            f"exec /usr/sbin/sshd -D -e -f {STATE / 'sshd_config'} -o ListenAddress={host.ip}",
        ]
    )
    log = open(host.home / "sshd.log", "ab")  # noqa: SIM115 - the child keeps it
    # its own PID namespace too: `ray stop` on one host must not see (and kill) another host's Ray
    unshare = ["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc", "--propagation", "private"]
    command = ["ip", "netns", "exec", host.netns, *unshare]
    process = subprocess.Popen([*command, "sh", "-c", script], stdout=log, stderr=log, start_new_session=True)
    (host.home / "sshd.pid").write_text(str(process.pid))


def ssh_command(host: Host, command: str) -> list[str]:
    return [
        "ssh",
        "-i",
        str(KEY),
        "-o",
        "StrictHostKeyChecking=no",
        "-o",
        "UserKnownHostsFile=/dev/null",
        "-o",
        "LogLevel=ERROR",
        "-o",
        f"ConnectTimeout={SSH_TIMEOUT_S}",
        f"root@{host.ip}",
        command,
    ]


def ssh(host: Host, command: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(ssh_command(host, command), capture_output=True, text=True, timeout=timeout, check=check)


def _wait_ssh(host: Host) -> None:
    deadline = time.monotonic() + 30
    while True:
        result = ssh(host, "hostname", timeout=SSH_TIMEOUT_S + 5, check=False)
        if result.returncode == 0 and result.stdout.strip() == host.netns:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {host.name} ({host.ip}) did not answer: {result.stderr.strip()}")
        time.sleep(0.5)


def netns_pids(host: Host) -> list[int]:
    result = run("ip", "netns", "pids", host.netns, check=False)
    return [int(p) for p in result.stdout.split()] if result.returncode == 0 else []


def down() -> None:
    """Every process in the hosts' namespaces ends (TERM, then KILL), then namespaces, bridge and state go."""
    existing = set(run("ip", "netns", "list", check=False).stdout.split())
    hosts = [h for h in HOSTS if h.netns in existing]
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        pids = [p for h in hosts for p in netns_pids(h)]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline and any(netns_pids(h) for h in hosts):
            time.sleep(0.2)
    for host in hosts:
        run("ip", "netns", "delete", host.netns, check=False)
    run("ip", "link", "delete", BRIDGE, check=False)
    if STATE.exists():
        shutil.rmtree(STATE)


def status() -> dict:
    existing = set(run("ip", "netns", "list", check=False).stdout.split())
    return {
        h.name: {
            "ip": h.ip,
            "netns": h.netns in existing,
            "processes": len(netns_pids(h)) if h.netns in existing else 0,
        }
        for h in HOSTS
    }


def main() -> None:
    verb = sys.argv[1] if len(sys.argv) > 1 else "status"
    if verb == "up":
        up()
        print(json.dumps(status()))
    elif verb == "down":
        down()
    elif verb == "status":
        print(json.dumps(status()))
    else:
        sys.exit("usage: hosts.py up | down | status")


if __name__ == "__main__":
    main()
