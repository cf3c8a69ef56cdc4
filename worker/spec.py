"""What one worker is, as one picklable value: ``WorkerSpec`` (name, role, engine, KV transfer, control plane).

``cluster/config.py`` builds every worker's spec (``worker_specs``), Ray pickles it into the worker actor, and each
role's constructor takes it whole. The only defaults are those of its dataclasses (``EngineConfig``,
``TransferConfig``, ``RuntimeOptions``), which the config's sections borrow. The spec carries GPUs, not a device (the
process that builds it may have none): ``resolve_spec`` picks the device inside the worker process, so a worker that
asked for GPUs and sees none fails, naming itself, instead of quietly running on the CPU; so does ``nccl`` on the CPU.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import socket
from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.config import EngineConfig, resolve_dtype
from transfer.config import TransferConfig
from worker.tracing import TracingOptions

# gloo: the nccl code on the CPU (how it is tested); shm: one node, payload through /dev/shm; auto: shm with senders
# on the receiver's node, zmq over TCP with the others
TransferBackend = Literal["zmq", "nccl", "gloo", "local", "shm", "auto"]
ZmqTransport = Literal["tcp", "ipc"]  # ipc: Unix sockets, only when prefill and decode share a node
FailurePolicy = Literal["fail", "recompute"]  # a lost transfer fails the request, or decode prefills it itself


DEFAULT_NCCL_PEERS = 7  # the other GPUs of an 8-GPU node: the pair groups a worker holds unless told otherwise


class WorkerRole(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # both phases in one engine: the baseline disaggregation must beat


@dataclass(slots=True)
class RuntimeOptions:
    """The worker's place in the control plane (worker/runtime.py)."""

    router_addresses: list[str]  # each router process's event socket; index = the router's index
    host: str = "127.0.0.1"  # where this worker binds its sockets ("auto": the node's IP, resolved by the actor)
    stats_interval_s: float = 0.2  # heartbeat period
    send_timeout_ms: int = 2000  # SNDTIMEO / RCVTIMEO on every control socket
    hwm: int = 100_000  # SNDHWM / RCVHWM (messages) on every control socket
    secret: str | None = None  # the cluster secret (required): commands not sealed with it are dropped and counted
    orphan_timeout_s: float = 10.0  # no word from a router this long: free its requests (it restarted or died)
    tracing: TracingOptions | None = None  # where request spans go (worker/tracing.py); None: tracing off
    max_body_bytes: int = 1 << 20  # the router's HTTP body bound: with max_model_len, the largest command's size
    router_queue_size: int = 256  # requests a router queues: with max_num_seqs, the commands it can have in flight

    def __post_init__(self) -> None:
        if isinstance(self.router_addresses, str):
            self.router_addresses = [self.router_addresses]
        self.router_addresses = list(self.router_addresses)
        for name in ("stats_interval_s", "send_timeout_ms", "hwm", "orphan_timeout_s", "max_body_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(slots=True)
class WorkerSpec:
    """Everything one worker needs, built by ``cluster.config.worker_specs`` (or by hand in tests)."""

    name: str
    role: WorkerRole
    engine: EngineConfig
    runtime: RuntimeOptions
    transfer: TransferConfig = field(default_factory=TransferConfig)
    transfer_backend: TransferBackend = "auto"
    zmq_transport: ZmqTransport = "tcp"
    stream_layers: bool = True  # prefill: send each layer's KV as it is computed (False: after the whole prompt)
    failure_policy: FailurePolicy = "fail"  # decode: what a failed transfer does to its request
    reserve_headroom_tokens: int = 0  # decode: reserved per request beyond prompt + first token
    gpus: float = 0.0  # what the pool asked for per replica (Ray's num_gpus); 0: a CPU worker
    # nccl: pair groups this worker will hold (the other pool's replicas), in its KV plan; None: DEFAULT_NCCL_PEERS
    nccl_peers: int | None = None
    pool: str = ""  # the config's pool it belongs to ("prefill", "decode"); default: its role's name
    # more than one rank (EngineConfig.ranks): the FileStore path where this incarnation's ranks meet (one node; the
    # pool picks it)
    tp_rendezvous: str = ""

    def __post_init__(self) -> None:
        self.role = WorkerRole(self.role)
        self.pool = self.pool or self.role.value
        _check_choice("transfer_backend", self.transfer_backend, TransferBackend)
        _check_choice("zmq_transport", self.zmq_transport, ZmqTransport)
        _check_choice("failure_policy", self.failure_policy, FailurePolicy)
        if self.reserve_headroom_tokens < 0:
            raise ValueError(f"reserve_headroom_tokens must be >= 0, got {self.reserve_headroom_tokens!r}")
        if self.gpus < 0:
            raise ValueError(f"gpus must be >= 0, got {self.gpus!r}")
        # one cluster secret for the control plane and the KV handshake: given once, it serves both
        secret, transfer_secret = self.runtime.secret, self.transfer.secret
        if secret and transfer_secret and secret != transfer_secret:
            raise ValueError(f"worker {self.name}: the control-plane and transfer secrets differ")
        if secret and not transfer_secret:
            self.transfer = dataclasses.replace(self.transfer, secret=secret)

    def with_host(self, host: str) -> WorkerSpec:
        """The same spec binding ``host`` (the actor resolves ``"auto"`` to its node's address)."""
        return dataclasses.replace(self, runtime=dataclasses.replace(self.runtime, host=host))


def _check_choice(name: str, value: str, choices: object) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def resolve_device(spec: WorkerSpec) -> str:
    """The engine's device, decided in the worker's own process: "cuda" when its pool asked for GPUs and one is
    visible, "cpu" when it asked for none; RuntimeError when it asked and sees none."""
    if spec.gpus <= 0:
        return "cpu"
    import torch  # here, in the worker's process: the cluster config imports this module and needs no torch

    if torch.cuda.is_available():
        return "cuda"
    raise RuntimeError(
        f"worker {spec.name}: its pool asks for {spec.gpus:g} GPU(s) per replica, but no GPU is visible to it "
        f"(torch.cuda.is_available() is False in pid {os.getpid()} on {socket.gethostname()}, "
        f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Check the node's driver and torch's "
        "CUDA build, or set gpus_per_replica: 0 to run this pool on the CPU"
    )


def resolve_spec(spec: WorkerSpec) -> WorkerSpec:
    """The spec as this process runs it: the engine on ``resolve_device``'s device, the transfer's device set for the
    backend (nccl moves device tensors, the others host ones). ``nccl`` on a CPU worker fails."""
    device = resolve_device(spec)
    if spec.transfer_backend == "nccl" and device == "cpu" and spec.role is not WorkerRole.COLOCATED:
        raise RuntimeError(
            f"worker {spec.name}: transfer.backend is nccl, which moves KV between GPUs, but this worker runs on the "
            "CPU (its pool has gpus_per_replica: 0). Use transfer.backend: gloo for the same code on the CPU"
        )
    transfer_device = device if spec.transfer_backend == "nccl" else "cpu"
    pairs = spec.transfer_backend == "nccl" and device != "cpu" and spec.role is not WorkerRole.COLOCATED
    peers = (DEFAULT_NCCL_PEERS if spec.nccl_peers is None else spec.nccl_peers) if pairs else 0
    engine = dataclasses.replace(
        spec.engine,
        device=device,
        dtype=resolve_dtype(spec.engine.dtype, device),
        prefill_only=spec.role is WorkerRole.PREFILL,  # no decode graphs
        nccl_peers=peers,
    )
    return dataclasses.replace(spec, engine=engine, transfer=dataclasses.replace(spec.transfer, device=transfer_device))
