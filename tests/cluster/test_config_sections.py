"""The YAML sections declare the worker settings they carry (cluster/config.py): each such field has the name, type and
default of its worker dataclass field, every engine and transfer field is either declared or deliberately left out of
the YAML, and the translation into worker specs passes every declared field over."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from cluster import config as cluster_config
from cluster.config import ModelSection, PoolSection, RouterSection, TransferSection, parse_config
from engine.config import EngineConfig
from transfer.config import TransferConfig
from worker.spec import RuntimeOptions, WorkerSpec


def _by_name(section: type, cls: type, **renamed: str) -> dict[str, str]:
    """Section field -> dataclass field: those of the same name, and ``renamed``."""
    fields = {item.name for item in dataclasses.fields(cls)}
    return {**{name: name for name in section.model_fields if name in fields}, **renamed}


# (section, worker dataclass, section field -> dataclass field) for every section field a worker runs with
CARRIED = [
    (ModelSection, EngineConfig, _by_name(ModelSection, EngineConfig)),
    (PoolSection, EngineConfig, _by_name(PoolSection, EngineConfig)),
    (PoolSection, WorkerSpec, _by_name(PoolSection, WorkerSpec)),
    (TransferSection, TransferConfig, _by_name(TransferSection, TransferConfig)),
    (TransferSection, WorkerSpec, _by_name(TransferSection, WorkerSpec, backend="transfer_backend")),
    # router.host is where the HTTP server binds, not the workers' RuntimeOptions.host
    (
        RouterSection,
        RuntimeOptions,
        {"orphan_timeout_s": "orphan_timeout_s", "max_body_bytes": "max_body_bytes", "queue_size": "router_queue_size"},
    ),
]

# EngineConfig and TransferConfig fields no section declares, and why: a new field fails
# test_every_engine_and_transfer_field_is_declared_or_left_out until it is declared in a section or listed here
NOT_IN_THE_YAML = {
    EngineConfig: {
        "model": "model.name, resolved to a folder by the launcher",
        "block_size": "transfer.block_size: one value for every worker",
        "kv_cache_memory_bytes": "pools.*.kv_memory_mb, in MiB",
        "device": "chosen inside each worker (worker.spec.resolve_spec)",
        "prefill_only": "set from the worker's role",
        "nccl_peers": "set from the other pool's replicas",
        "memory_reserve_bytes": "an engine constant, not a user setting",
    },
    TransferConfig: {
        "device": "set from the backend inside each worker (worker.spec.resolve_spec)",
        "kv_device": "set by the decode worker from its engine's device",
        "gpu_uuid": "read from the worker's GPU",
        **dict.fromkeys(
            [
                "connect_timeout_s",
                "send_timeout_s",
                "socket_timeout_ms",
                "hwm",
                "queue_size",
                "enqueue_timeout_s",
                "max_frame_bytes",
                "group_timeout_s",
                "idle_session_s",
                "max_sessions",
                "max_outbox_bytes",
                "staging_bytes",
            ],
            "a transfer-layer limit kept at its default",
        ),
    },
}


def _dataclass_field(cls: type, name: str) -> tuple[object, object]:
    """(type, default) of one dataclass field."""
    field = {item.name: item for item in dataclasses.fields(cls)}[name]
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        raise AssertionError(f"{cls.__name__}.{name} has no default: a section cannot leave it out")
    return typing.get_type_hints(cls)[name], default


@pytest.mark.parametrize(
    ("section", "cls", "carried"), CARRIED, ids=[f"{s.__name__}-{c.__name__}" for s, c, _ in CARRIED]
)
def test_a_carried_field_has_its_worker_fields_type_and_default(section, cls, carried):
    assert carried, f"{section.__name__} carries no field of {cls.__name__}"
    for field_name, dataclass_name in carried.items():
        declared = section.model_fields[field_name]
        expected_type, expected_default = _dataclass_field(cls, dataclass_name)
        where = f"{section.__name__}.{field_name} against {cls.__name__}.{dataclass_name}"
        assert declared.annotation == expected_type, where
        assert declared.get_default(call_default_factory=True) == expected_default, where


@pytest.mark.parametrize("cls", [EngineConfig, TransferConfig], ids=lambda cls: cls.__name__)
def test_every_engine_and_transfer_field_is_declared_or_left_out(cls):
    declared = {name for _, carrier, carried in CARRIED if carrier is cls for name in carried.values()}
    fields = {item.name for item in dataclasses.fields(cls)}
    left_out = set(NOT_IN_THE_YAML[cls])
    assert not declared & left_out, f"declared in a section, yet listed as left out: {sorted(declared & left_out)}"
    assert left_out <= fields, f"listed as left out, but {cls.__name__} has no such field: {sorted(left_out - fields)}"
    missing = sorted(fields - declared - left_out)
    assert not missing, (
        f"{cls.__name__} fields neither declared in a section of cluster/config.py nor listed in NOT_IN_THE_YAML: "
        f"{missing}"
    )


class _Recorder:
    """Stands in for a worker dataclass (whose fields it shows): keeps the keyword arguments it was built with."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.kwargs = kwargs


def _recorder(cls: type) -> type:
    return type(cls.__name__, (_Recorder,), {"__dataclass_fields__": cls.__dataclass_fields__})


def test_the_worker_specs_get_every_carried_field(monkeypatch):
    config = parse_config({"pools": {"decode": {"kv_blocks": 7, "speculative": {"num_tokens": 2}}}})
    for cls in (EngineConfig, TransferConfig, WorkerSpec, RuntimeOptions):
        monkeypatch.setattr(cluster_config, cls.__name__, _recorder(cls))
    spec = config.worker_specs("/model", ["tcp://127.0.0.1:1"], "127.0.0.1")[-1].kwargs
    assert spec["name"] == "decode-0"
    built = {
        EngineConfig: spec["engine"].kwargs,
        TransferConfig: spec["transfer"].kwargs,
        WorkerSpec: spec,
        RuntimeOptions: spec["runtime"].kwargs,
    }
    sections = {
        ModelSection: config.model,
        PoolSection: config.pools.decode,
        TransferSection: config.transfer,
        RouterSection: config.router,
    }
    for section, cls, carried in CARRIED:
        for field_name, dataclass_name in carried.items():
            where = f"{section.__name__}.{field_name} -> {cls.__name__}.{dataclass_name}"
            assert dataclass_name in built[cls], where
            assert built[cls][dataclass_name] == getattr(sections[section], field_name), where
    assert built[EngineConfig]["kv_blocks"] == 7 and built[EngineConfig]["speculative"].num_tokens == 2
