"""What a profile holds and how the simulator reads it: measured step times and the curves fitted to them.

``pdserve profile`` (planner/profiler.py) writes it and ``pdserve plan`` reads it, on different machines and days,
so it records what it was measured on next to the points. The simulator asks only these, from least-squares fits
(so sizes that were not measured work too):
- ``prefill_s(tokens, context)``: one forward over ``tokens`` new prompt tokens after ``context`` cached ones;
- ``decode_step_s(batch, context_tokens)``: one decode step for ``batch`` requests holding that much KV in total;
- ``transfer_s(num_bytes)``: one request's KV from a prefill to a decode worker.
A profile is one worker layout's (its tensor degree, and its expert degree: the ways its routed experts are split over
those ranks); ``ProfileSet`` holds one per layout for a plan that searches them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from engine.config import worker_ranks

PROFILE_VERSION = 1


class Degree(NamedTuple):
    """A worker's parallel layout: the ways its ranks cut every layer (``tensor_parallel_size``) and its routed
    experts (``expert_parallel_size``: 1, the same, or any at tensor degree 1); its ranks are the larger."""

    tensor: int = 1
    expert: int = 1

    @property
    def ranks(self) -> int:
        return worker_ranks(self.tensor, self.expert)

    @property
    def label(self) -> str:
        return f"tp{self.tensor}" + (f" ep{self.expert}" if self.expert > 1 else "")


# the fits' features (``feature_value``): what a step's or a transfer's time is linear in
PREFILL_FEATURES = ["1", "tokens", "tokens*context", "tokens*tokens"]
DECODE_FEATURES = ["1", "batch", "context_tokens"]
TRANSFER_FEATURES = ["1", "num_bytes"]


@dataclass(slots=True)
class PrefillPoint:
    tokens: int  # new prompt tokens in the forward
    context: int  # tokens already in the KV cache before them (0 for a prompt's first chunk)
    seconds: float


@dataclass(slots=True)
class DecodePoint:
    batch: int  # requests decoded in the step
    context_tokens: int  # their KV, in total
    seconds: float


@dataclass(slots=True)
class TransferPoint:
    num_bytes: int
    seconds: float


@dataclass(slots=True)
class Fit:
    """``seconds = sum(coef_i * feature_i)`` over the features named in ``features`` (``1`` is the constant)."""

    features: list[str]
    coefficients: list[float]

    def __call__(self, **values: float) -> float:
        total = sum(coef * feature_value(name, values) for name, coef in zip(self.features, self.coefficients))
        return max(total, 0.0)


def feature_value(name: str, values: Mapping[str, float]) -> float:
    """A feature is the constant ``1``, a variable (``tokens``) or a product (``tokens*context``)."""
    return 1.0 if name == "1" else math.prod(float(values[part]) for part in name.split("*"))


@dataclass(slots=True)
class Profile:
    model: str
    dtype: str
    device: str  # "cpu", or the GPU's name
    backend: str  # the transfer backend measured (zmq, shm, gloo, nccl, local)
    date: str  # ISO 8601, when it was measured
    block_size: int
    kv_bytes_per_token: int
    max_batch_tokens: int  # the prefill pool's chunk size when measured
    max_num_seqs: int  # the decode pool's batch bound when measured
    prefill_points: list[PrefillPoint] = field(default_factory=list)
    decode_points: list[DecodePoint] = field(default_factory=list)
    transfer_points: list[TransferPoint] = field(default_factory=list)
    prefill_fit: Fit | None = None  # features of tokens and context
    decode_fit: Fit | None = None  # features of batch and context_tokens
    transfer_fit: Fit | None = None  # features of num_bytes
    notes: str = ""  # how it was measured (threads, repeats), shown with every plan made from it
    version: int = PROFILE_VERSION
    tensor_parallel_size: int = 1  # ranks of the measured worker; its step times are the whole worker's
    expert_parallel_size: int = 1  # the ways its routed experts were split over those ranks
    num_kv_heads: int = 0  # the model's (0: not recorded); a tensor-parallel rank holds its share of them
    kv_blocks: int = 0  # KV blocks the measured worker's engine got (0: not recorded); a GPU pool's from free memory

    def prefill_s(self, tokens: int, context: int = 0) -> float:
        assert self.prefill_fit is not None, "profile has no prefill fit"
        return self.prefill_fit(tokens=tokens, context=context)

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        assert self.decode_fit is not None, "profile has no decode fit"
        return self.decode_fit(batch=batch, context_tokens=context_tokens)

    def transfer_s(self, num_bytes: int) -> float:
        if self.transfer_fit is None:  # a colocated-only profile
            return 0.0
        return self.transfer_fit(num_bytes=num_bytes)

    # ---- files -----------------------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        data = json.loads(Path(path).read_text())
        if data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{path}: profile version {data.get('version')!r}, this pdserve reads {PROFILE_VERSION}")
        points = (("prefill_points", PrefillPoint), ("decode_points", DecodePoint), ("transfer_points", TransferPoint))
        for name, kind in points:
            data[name] = [kind(**p) for p in data.get(name, [])]
        for name in ("prefill_fit", "decode_fit", "transfer_fit"):
            data[name] = Fit(**data[name]) if data.get(name) else None
        return cls(**data)

    @property
    def degree(self) -> Degree:
        return Degree(self.tensor_parallel_size, self.expert_parallel_size)


@dataclass(slots=True)
class ProfileSet:
    """One profile per worker layout (tensor and expert degree) of one model, dtype and block size: what a search
    over layouts reads."""

    by_degree: dict[Degree, Profile]

    @classmethod
    def of(cls, profiles: list[Profile]) -> ProfileSet:
        if not profiles:
            raise ValueError("--profile: at least one profile is needed")
        first = profiles[0]
        by_degree: dict[Degree, Profile] = {}
        for profile in profiles:
            for name in ("model", "dtype", "block_size", "kv_bytes_per_token"):
                if getattr(profile, name) != getattr(first, name):
                    raise ValueError(
                        f"--profile: the profiles differ in {name} ({getattr(first, name)!r} and "
                        f"{getattr(profile, name)!r}): a plan compares degrees of one model and KV layout"
                    )
            if profile.degree in by_degree:
                raise ValueError(
                    f"--profile: two profiles of tensor_parallel_size {profile.tensor_parallel_size}, "
                    f"expert_parallel_size {profile.expert_parallel_size}"
                )
            by_degree[profile.degree] = profile
        return cls(dict(sorted(by_degree.items())))

    @property
    def degrees(self) -> list[Degree]:
        return list(self.by_degree)

    def at(self, degree: Degree) -> Profile:
        if degree not in self.by_degree:
            profiled = ", ".join(d.label for d in self.degrees)
            raise ValueError(f"no profile of {degree.label} (profiled: {profiled})")
        return self.by_degree[degree]

    def transfer_s(self, num_bytes: int, decode_degree: int = 1) -> float:
        """One request's whole KV into a decode worker of ``decode_degree``, each of whose ranks takes its own heads
        at once (the fit maps the whole request's bytes to the time of one rank's share): by that degree's transfer
        fit, else by the lowest degree's that has one (0 if none does: a colocated profile)."""
        same = [p for d, p in self.by_degree.items() if d.tensor == decode_degree]
        candidates = [*same, *self.by_degree.values()]
        fitted = next((p for p in candidates if p is not None and p.transfer_fit is not None), None)
        return 0.0 if fitted is None else fitted.transfer_s(num_bytes)

    @property
    def first(self) -> Profile:
        return next(iter(self.by_degree.values()))
