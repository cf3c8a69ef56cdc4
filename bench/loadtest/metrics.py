"""From per-request results to a run summary, and from a sweep of runs to the highest rate that meets the SLOs.

Times are the client's (``client.py``), reported in ms; percentiles are ``numpy.percentile``'s linear interpolation,
as vLLM reports. ITL pools every gap of all successful requests. Duration runs from the measured phase's first send
to the end of its last request (or the bound); throughputs and goodput (successful requests meeting every SLO, ``<=``)
divide by it. SLO attainment: those / all measured requests, failed included, in %. Cached tokens count only the
requests that reported them (``None`` when none did: not a 0 % hit). A sweep picks the highest rate with attainment
>= ``target`` (90%: DistServe's goodput), also per worker.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from bench.loadtest.client import TIMING_FIELDS, RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS = ("ttft", "tpot", "e2el")
BASE_PERCENTILES = (50.0, 90.0, 99.0)


def parse_goodput(items: Iterable[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (ms, as ``vllm bench serve --goodput``) to ``{"ttft": 500.0, "tpot": 50.0}``."""
    slos: dict[str, float] = {}
    for item in items or []:
        for part in item.replace(",", " ").split():
            name, sep, value = part.partition(":")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"--goodput: {part!r} is not NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
            try:
                slos[name] = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {part!r}: {value!r} is not a number of milliseconds") from None
            if slos[name] <= 0:
                raise ValueError(f"--goodput: {part!r}: the target must be positive")
    return slos


def parse_list(text: str | None, name: str, kind=float) -> list:
    if text is None or str(text).strip() == "":
        return []
    try:
        return [kind(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a comma-separated list of numbers") from None


def percentile_key(p: float) -> str:
    return f"p{int(p) if float(p).is_integer() else p}"


def describe(values: Sequence[float], percentiles: Iterable[float] = BASE_PERCENTILES, scale: float = 1.0) -> dict:
    """mean, median, std, min, max and the percentiles of ``values * scale``; all None when empty."""
    keys = ["mean", "median", "std", "min", "max"] + [percentile_key(p) for p in percentiles]
    if len(values) == 0:
        return {k: None for k in keys} | {"count": 0}
    array = np.asarray(values, dtype=float) * scale
    out = {
        "mean": float(array.mean()),
        "median": float(np.median(array)),
        "std": float(array.std()),
        "min": float(array.min()),
        "max": float(array.max()),
    }
    for p in percentiles:
        out[percentile_key(p)] = float(np.percentile(array, p))
    out["count"] = int(array.size)
    return out


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    """Success and every given target (ms) met; a metric the request lacks fails its target."""
    if not result.success:
        return False
    values = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2el": result.e2el_s}
    for name, target_ms in slos.items():
        value = values[name]
        if value is None or value * 1000.0 > target_ms:
            return False
    return True


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: Iterable[float] = BASE_PERCENTILES,
    percentile_metrics: Iterable[str] = METRICS,
) -> dict:
    """The figures of one measured phase (warm-up results must already be left out)."""
    slos = slos or {}
    percentiles = sorted(set(BASE_PERCENTILES) | {float(p) for p in percentiles})
    ok = [r for r in results if r.success]
    failures = Counter(r.error or "unknown" for r in results if not r.success)
    input_tokens = sum(r.input_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    per = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    summary: dict = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(sorted(failures.items())),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per(len(ok)),
        "input_token_throughput": per(input_tokens),
        "output_token_throughput": per(output_tokens),
        "total_token_throughput": per(input_tokens + output_tokens),
    }
    series = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in ok if r.tpot_s is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "e2el": [r.e2el_s for r in ok if r.e2el_s is not None],
    }
    for name in METRICS:
        if name in percentile_metrics:
            summary[f"{name}_ms"] = describe(series[name], percentiles, scale=1000.0)
    if slos:
        good = sum(meets_slos(r, slos) for r in results)
        summary["slo_ms"] = dict(slos)
        summary["good_requests"] = good
        summary["goodput"] = per(good)
        summary["slo_attainment_pct"] = 100.0 * good / len(results) if results else None
    else:
        summary["slo_ms"], summary["good_requests"], summary["goodput"], summary["slo_attainment_pct"] = (
            {},
            None,
            None,
            None,
        )
    summary["server_timing_ms"] = server_timing_summary(ok)
    summary["cached_tokens"] = cached_tokens_summary(ok)
    summary["input_tokens_mismatch"] = sum(
        1
        for r in ok
        if r.input_tokens is not None
        and r.expected_input_tokens is not None
        and r.input_tokens != r.expected_input_tokens
    )
    summary["output_tokens_short"] = sum(
        1
        for r in ok
        if r.output_tokens is not None
        and r.requested_output_tokens is not None
        and r.output_tokens < r.requested_output_tokens
    )
    summary["multi_token_chunk_requests"] = sum(
        1 for r in ok if r.output_tokens is not None and r.output_tokens > r.content_chunks
    )
    summary["output_tokens_from_tokenizer"] = sum(1 for r in ok if r.output_tokens_source == "tokenizer")
    return summary


def cached_tokens_summary(results: Sequence[RequestResult]) -> dict | None:
    """Prompt tokens served from the prefix cache, over only the requests that reported a figure (others not 0)."""
    reporting = [r for r in results if r.cached_tokens is not None]
    if not reporting:
        return None
    total = sum(r.cached_tokens or 0 for r in reporting)
    prompt = sum(r.input_tokens or 0 for r in reporting)
    return {
        "requests_reporting": len(reporting),
        "total": total,
        "mean": total / len(reporting),
        "prompt_tokens": prompt,
        "fraction": total / prompt if prompt else None,
    }


def server_timing_summary(results: Sequence[RequestResult]) -> dict:
    """Per stage: mean, median, p90 (ms) over the requests that reported it; {} when none did.
    ``client_minus_server_ttft`` (client TTFT - server ``ttft_s``) is network, HTTP and client overhead."""
    stages: dict = {}
    for name in TIMING_FIELDS:
        values = [
            float(r.server_timing[name])
            for r in results
            if r.server_timing and isinstance(r.server_timing.get(name), (int, float))
        ]
        if values:
            d = describe(values, (50.0, 90.0), scale=1000.0)
            stages[name.removesuffix("_s")] = {k: d[k] for k in ("mean", "median", "p90", "count")}
    gaps = [
        r.ttft_s - float(r.server_timing["ttft_s"])
        for r in results
        if r.server_timing and isinstance(r.server_timing.get("ttft_s"), (int, float)) and r.ttft_s is not None
    ]
    if gaps:
        d = describe(gaps, (50.0, 90.0), scale=1000.0)
        stages["client_minus_server_ttft"] = {k: d[k] for k in ("mean", "median", "p90", "count")}
    return stages


def pick_max_rate(runs: Sequence[dict], target_pct: float = 90.0, num_workers: int | None = None) -> dict:
    """The highest swept rate whose attainment is at least ``target_pct``; ``monotonic`` False (a lower rate
    missed it: noise, or a server doing better under load) says to read the sweep with care."""
    rated = [(r["rate"], r.get("slo_attainment_pct")) for r in runs]
    passing = [rate for rate, pct in rated if pct is not None and pct >= target_pct]
    best = max(passing, key=_rate_value) if passing else None
    monotonic = best is None or all(
        pct is not None and pct >= target_pct for rate, pct in rated if _rate_value(rate) < _rate_value(best)
    )
    per_worker = None
    if best is not None and num_workers:
        per_worker = _rate_value(best) / num_workers if best != "inf" else "inf"
    return {
        "target_attainment_pct": target_pct,
        "max_rate_meeting_slo": best,
        "num_workers": num_workers,
        "max_rate_per_worker": per_worker,
        "monotonic": monotonic,
    }


def _rate_value(rate) -> float:
    return math.inf if rate in ("inf", None) else float(rate)
