"""What the engine does on CUDA that the CPU cannot run, checked where only a decision depends on CUDA.

- The end of a step waits for the compute stream only, never the whole device (which would also wait for NCCL
  receives and the transfer side streams: a slow peer would stall every decode step).
- Host values reach the device through pinned memory and a non-blocking copy, never a pageable ``torch.tensor(...,
  device=...)``; the streamed KV export builds its block index once per step, not once per layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import engine.host_values as host_values
import engine.model_runner as model_runner
from engine.kv_cache import KVCache
from engine.kv_connector import KVBlocksReady
from engine.request import SamplingParams
from tests.helpers.engine import random_prompts

REPO = Path(__file__).resolve().parents[2]
# the modules a step runs through: forward, attention, KV export and import, sampling, graphs
HOT_PATH = [
    "engine/model_runner.py",
    "engine/kv_cache.py",
    "engine/kv_connector.py",
    "engine/sampler.py",
    "engine/decode_graphs.py",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "engine" / "attention").glob("*.py")),
]


class FakeStream:
    def __init__(self) -> None:
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1


def test_a_step_waits_for_its_stream_not_the_device(monkeypatch):
    stream = FakeStream()
    asked: list[torch.device] = []

    def current_stream(device):
        asked.append(device)
        return stream

    def device_wide(*args):
        raise AssertionError("a step must not synchronize the whole device")

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", device_wide)
    model_runner.wait_for_compute(torch.device("cuda", 1))
    assert stream.synchronized == 1 and asked == [torch.device("cuda", 1)]
    model_runner.wait_for_compute(torch.device("cpu"))  # nothing to wait for on the CPU
    assert stream.synchronized == 1


def test_a_step_whose_collectives_are_on_nccl_ends_with_the_groups_bounded_wait(monkeypatch):
    """On NCCL the all-reduces are in the step's stream: the end of the step waits for it through the group, whose
    wait gives up (and aborts the group) after its timeout instead of hanging on a dead rank."""

    class Group:
        device_backend = "nccl"
        waited = 0

        def wait_device(self) -> None:
            self.waited += 1

    def never(*args):
        raise AssertionError("the unbounded stream wait must not be used under an NCCL group")

    monkeypatch.setattr(torch.cuda, "current_stream", never)
    group = Group()
    model_runner.wait_for_compute(torch.device("cuda", 0), group)  # type: ignore[arg-type]
    assert group.waited == 1


def test_every_step_ends_with_the_stream_wait(tiny_llama_path, make_engine, monkeypatch):
    waits: list[torch.device] = []
    monkeypatch.setattr(model_runner, "wait_for_compute", lambda device, group=None: waits.append(device))
    engine = make_engine(tiny_llama_path)
    engine.generate(random_prompts(2, 10, 10, seed=1), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(waits) == len(engine.step_stats) == 3 and set(waits) == {torch.device("cpu")}


class FakeHost:
    """What ``torch.tensor(..., pin_memory=True)`` returns in the test: a CPU tensor whose ``to`` records the copy."""

    def __init__(self, tensor: torch.Tensor, copies: list[dict]) -> None:
        self.tensor, self.copies = tensor, copies

    def to(self, device, non_blocking=False):
        self.copies.append({"device": torch.device(device), "non_blocking": non_blocking})
        return self.tensor


def test_host_values_go_pinned_and_non_blocking_on_cuda(monkeypatch):
    real = torch.tensor
    made: list[dict] = []
    copies: list[dict] = []

    def tensor(values, dtype=None, device=None, pin_memory=False):
        made.append({"device": device, "pin_memory": pin_memory})
        return FakeHost(real(values, dtype=dtype), copies)

    monkeypatch.setattr(host_values.torch, "tensor", tensor)
    out = host_values.long_tensor([3, 1, 2], "cuda:0")
    assert out.tolist() == [3, 1, 2] and out.dtype == torch.long
    assert made == [{"device": None, "pin_memory": True}]  # built on the host, in pinned memory
    assert copies == [{"device": torch.device("cuda", 0), "non_blocking": True}]
    monkeypatch.setattr(host_values.torch, "tensor", real)
    assert host_values.to_device([0.5, 2.0], torch.float32, "cpu").tolist() == [0.5, 2.0]


def _pageable_device_tensors(path: Path) -> list[int]:
    """Lines of ``torch.tensor(..., device=...)`` / ``torch.as_tensor(..., device=...)`` calls in a module."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            named = node.func.attr in ("tensor", "as_tensor") and getattr(node.func.value, "id", None) == "torch"
            if named and any(k.arg == "device" for k in node.keywords):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("module", HOT_PATH)
def test_no_pageable_host_to_device_copy_on_the_step_path(module):
    assert _pageable_device_tensors(REPO / module) == [], f"{module}: use engine.host_values.to_device"


def test_streamed_export_builds_its_block_index_once_per_step(tiny_llama_path, make_engine, monkeypatch):
    engine = make_engine(tiny_llama_path, max_batch_tokens=32)
    num_layers = engine.kv_spec.num_layers
    built: list[list[int]] = []
    real = KVCache.block_index

    def block_index(self, block_ids):
        built.append(list(block_ids))
        return real(self, block_ids)

    monkeypatch.setattr(KVCache, "block_index", block_index)
    reports: list[KVBlocksReady] = []
    [prompt] = random_prompts(1, 70, 70, seed=2)  # chunks of 32, 32, 6 tokens: 3 steps
    engine.add_request(prompt, SamplingParams(max_tokens=1), "p", prefill_only=True, kv_sink=reports.append)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    assert steps == 3 and len(reports) == 3 * num_layers  # every layer of every step reported its blocks
    assert len(built) == 3  # one index per step, shared by the layers
    request_blocks = [b for ids in built for b in ids]
    assert len(request_blocks) == len(set(request_blocks)) == 5  # 70 tokens: blocks 0-4, each reported once
    engine.release("p")
