"""The planner's model for the live autoscaler: replicas per pool from a profile and one interval's load.

Closed form, not the simulator (a goodput search takes seconds per layout, and a live load is not a trace), with the
same fits: busy replicas per pool (prefill or its KV sending, decode at the largest batch within the TPOT SLO, or
both added in one colocated pool), where ``rate`` counts queued requests as arrivals of the next interval. Each is
divided by ``target_utilization`` and rounded up, at least 1; cluster/run/autoscale.py clamps it and applies
hysteresis. The formulas: docs/planner.md "With a profile: the planner's model".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from cluster.config import ClusterConfig
from cluster.run.autoscale import LiveLoad
from planner.profile_model import Profile

logger = logging.getLogger(__name__)

_EPS = 1e-9  # 2.0000000001 busy replicas is 2 (floating-point sums of fitted times)


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """What the served config lets one replica do (not the profile's measuring settings)."""

    prefill_chunk_tokens: int  # prefill pool's max_batch_tokens (colocated: the decode pool's)
    decode_max_num_seqs: int
    decode_kv_tokens: int | None  # KV tokens one decode replica holds; None: unknown until a GPU worker measures it


@dataclass(frozen=True, slots=True)
class Estimate:
    """The model's working for one load: busy replicas per resource, and the replicas it asks for."""

    prefill_busy: float  # prefill seconds per second
    transfer_busy: float  # KV-sending seconds per second
    decode_busy: float  # decode replicas' worth of tokens per second at the batch within the SLO
    decode_batch: int  # that batch
    needed: dict[str, int]


@dataclass(slots=True)
class ProfileCapacityModel:
    """``CapacityModel`` (cluster/run/autoscale.py) from a ``Profile``."""

    profile: Profile
    mode: str  # "disaggregated" or "colocated"
    tpot_slo_s: float
    target_utilization: float
    limits: PoolLimits

    @classmethod
    def from_config(cls, config: ClusterConfig, profile: Profile) -> ProfileCapacityModel:
        decode = config.pools.decode
        chunk_pool = config.pools.prefill if config.mode == "disaggregated" else decode
        kv_tokens = None
        if decode.kv_blocks is not None:
            kv_tokens = decode.kv_blocks * config.transfer.block_size
        else:
            kv_bytes = config.pool_kv_bytes(decode)
            if kv_bytes is not None and profile.kv_bytes_per_token > 0:
                kv_tokens = kv_bytes // profile.kv_bytes_per_token
        limits = PoolLimits(chunk_pool.max_batch_tokens, decode.max_num_seqs, kv_tokens)
        return cls(profile, config.mode, config.slo.tpot_s, config.autoscale.target_utilization, limits)

    def prefill_s(self, prompt: int) -> float:
        """One prompt's prefill, in the served pool's chunks (each after the earlier ones' context)."""
        chunk, total, done = max(1, self.limits.prefill_chunk_tokens), 0.0, 0
        while done < prompt:
            step = min(chunk, prompt - done)
            total += self.profile.prefill_s(step, done)
            done += step
        return total

    def decode_batch(self, prompt: float, output: float) -> tuple[int, float]:
        """The largest batch one decode replica runs within the TPOT SLO, and its step time."""
        context = prompt + output / 2  # a request's KV halfway through its output, on average
        largest = self.limits.decode_max_num_seqs
        if self.limits.decode_kv_tokens is not None:
            largest = min(largest, max(1, int(self.limits.decode_kv_tokens // max(1.0, prompt + output))))
        best = (1, self.profile.decode_step_s(1, round(context)))
        for batch in range(2, largest + 1):
            step = self.profile.decode_step_s(batch, round(batch * context))
            if step > self.tpot_slo_s + _EPS:
                break
            best = (batch, step)
        return best

    def estimate(self, load: LiveLoad) -> Estimate | None:
        """None when the load's token mix is unknown and requests are arriving (no request has finished yet)."""
        rate = load.arrival_rate + load.queue_depth / max(load.interval_s, _EPS)
        pools = ("decode",) if self.mode == "colocated" else ("prefill", "decode")
        if rate <= 0:
            return Estimate(0.0, 0.0, 0.0, 0, {pool: 1 for pool in pools})
        if load.mean_prompt_tokens is None or load.mean_output_tokens is None:
            return None
        prompt, output = load.mean_prompt_tokens, load.mean_output_tokens
        prefill_busy = rate * self.prefill_s(max(1, round(prompt)))
        transfer_busy = 0.0
        if self.mode == "disaggregated":
            transfer_busy = rate * self.profile.transfer_s(round(prompt) * self.profile.kv_bytes_per_token)
        batch, step = self.decode_batch(prompt, output)
        decode_busy = rate * max(0.0, output - 1) / (batch / step) if step > 0 else 0.0
        if self.mode == "colocated":
            needed = {"decode": self._replicas(prefill_busy + decode_busy)}
        else:
            needed = {
                "prefill": self._replicas(max(prefill_busy, transfer_busy)),
                "decode": self._replicas(decode_busy),
            }
        return Estimate(prefill_busy, transfer_busy, decode_busy, batch, needed)

    def replicas_needed(self, load: LiveLoad) -> dict[str, int]:
        estimate = self.estimate(load)
        return {} if estimate is None else estimate.needed

    def _replicas(self, busy: float) -> int:
        return max(1, math.ceil(busy / self.target_utilization - _EPS))


def capacity_model_for(config: ClusterConfig) -> ProfileCapacityModel | None:
    """None unless ``autoscale.profile`` names one; a profile of another model or dtype loads with a warning."""
    path = config.autoscale.profile
    if path is None:
        return None
    try:
        profile = Profile.load(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"autoscale.profile: cannot read {path}: {exc}") from None
    if profile.prefill_fit is None or profile.decode_fit is None:
        raise ValueError(f"autoscale.profile: {path} has no prefill or decode fit (write it with `pdserve profile`)")
    served = (config.model.name, config.served_dtype)
    if (profile.model, profile.dtype) != served:
        logger.warning(
            "autoscale.profile %s was measured on %s (%s, %s), the cluster serves %s (%s): its step times are a guess",
            path,
            profile.model,
            profile.dtype,
            profile.device,
            *served,
        )
    return ProfileCapacityModel.from_config(config, profile)
