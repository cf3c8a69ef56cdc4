"""The roofline profile (planner/roofline.py) beside step and transfer times others measured and published for the
same model and GPU: the tables of docs/planner.md, "The roofline against published measurements".

- vLLM's nightly latency benchmark (https://buildkite.com/vllm/performance-benchmark, builds 9555 on H100, 9513 on
  H200, 9523 on A100-SXM4-80GB): 8 requests of 32 prompt and 128 output tokens in one batch, median end-to-end
  latency. The roofline's figure is the simulator's for the same 8 requests on one colocated worker.
- Splitwise's profiles (Patel et al., ISCA '24; their simulator's data/perf_model.csv in Mutinifni/splitwise-sim,
  MIT): Llama-2-70B on DGX-A100 and DGX-H100 at tensor-parallel degree 2, 4 and 8, the prompt phase of ``batch``
  prompts of ``prompt_size`` tokens and the mean time per output token of that batch over 128 tokens (medians of
  their five repeats). Their batch-64 rows are left out: the prompt phase of 64 prompts is faster there than of 32.
- Mooncake's Transfer Engine (kvcache-ai/Mooncake README): 40 GB, the KV of 128k tokens of Llama-3-70B, at 87 GB/s
  over 4 x 200 Gb/s RoCE NICs, 21.75 GB/s per NIC; the roofline sends a request's KV over one 200 Gb/s link.

``python -m benchmarks.published_profiles --splitwise-csv perf_model.csv`` prints the tables;
``--write-profile h100-80gb:8:OUT.json`` also writes Splitwise's measurements at that GPU and degree as a pdserve
profile (their points, fitted as ``pdserve profile`` fits its own; the transfer and KV blocks are the roofline's,
which Splitwise did not measure), for ``pdserve plan --profile OUT.json``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import defaultdict
from dataclasses import replace

from planner.fit import fit_points
from planner.kv_sizing import load_shape
from planner.profile_model import DECODE_FEATURES, DecodePoint, PrefillPoint, Profile
from planner.roofline import roofline_profile
from planner.simulator import Layout, SimSettings, simulate
from planner.trace import TraceRequest

VLLM_LATENCY_MS = {  # (preset, degree, GPU): (median e2e ms of the batch, buildkite build)
    ("llama-3.1-8b", 1, "h100-sxm"): (997.4, 9555),
    ("llama-3.1-70b", 4, "h100-sxm"): (2444.3, 9555),  # their Llama-3-70B: the same shape as 3.1's
    ("llama-3.1-8b", 1, "h200"): (834.0, 9513),
    ("llama-3.1-70b", 4, "h200"): (2075.4, 9513),
    ("llama-3.1-8b", 1, "a100-80gb"): (1579.3, 9523),
    ("llama-3.1-70b", 4, "a100-80gb"): (3990.4, 9523),
}
SPLITWISE_GPUS = {"h100-80gb": "h100-sxm", "a100-80gb": "a100-80gb"}
MOONCAKE_BYTES, MOONCAKE_GB_S_PER_NIC = 40 * 2**30, 87.0 / 4  # the README's "40 GB": 128k tokens x 320 KiB


def roofline(model: str, gpu: str, degree: int) -> Profile:
    return roofline_profile(load_shape(model), gpu, "bfloat16", degree)


def batch_latency_s(profile: Profile, batch: int, prompt: int, output: int) -> float:
    """The simulator's end-to-end time of ``batch`` requests sent together to one colocated worker."""
    settings = SimSettings(
        prefill_max_batch_tokens=8192, decode_max_batch_tokens=8192, decode_max_num_seqs=256, hop_s=0.0
    )
    requests = [TraceRequest(0.0, prompt, output) for _ in range(batch)]
    layout = Layout("colocated", 0, 1, decode_tp=profile.tensor_parallel_size, decode_ep=profile.expert_parallel_size)
    return max(r.e2e_s for r in simulate(profile, requests, layout, settings))


def vllm_table() -> list[tuple]:
    rows = []
    for (model, degree, gpu), (measured_ms, build) in VLLM_LATENCY_MS.items():
        estimate_ms = batch_latency_s(roofline(model, gpu, degree), 8, 32, 128) * 1000
        rows.append((model, degree, gpu, build, measured_ms, estimate_ms, estimate_ms / measured_ms - 1))
    return rows


def splitwise_points(path: str) -> dict[tuple[str, int], list[tuple[int, int, int, float, float]]]:
    """(hardware, degree) -> (prompt_size, batch, token_size, prompt s, token s), medians of the repeats."""
    repeats: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            if row["model"] != "llama2-70b" or row["hardware"] not in SPLITWISE_GPUS or row["batch_size"] == "64":
                continue
            key = (row["hardware"], int(row["tensor_parallel"]), int(row["prompt_size"]), int(row["batch_size"]))
            repeats[key + (int(row["token_size"]),)].append((float(row["prompt_time"]), float(row["token_time"])))
    out: dict[tuple[str, int], list] = defaultdict(list)
    for (hardware, degree, prompt, batch, tokens), values in sorted(repeats.items()):
        prompt_s = statistics.median(v[0] for v in values) / 1000
        token_s = statistics.median(v[1] for v in values) / 1000
        out[hardware, degree].append((prompt, batch, tokens, prompt_s, token_s))
    return out


def roofline_phases(profile: Profile, prompt: int, batch: int, tokens: int) -> tuple[float, float]:
    """The roofline's prompt phase of ``batch`` prompts (one step, attention per prompt, as the simulator charges it)
    and its mean decode step over ``tokens`` output tokens of that batch."""
    prompt_s = batch * profile.prefill_s(prompt, 0) - (batch - 1) * profile.prefill_s(0, 0)
    token_s = statistics.mean(profile.decode_step_s(batch, batch * (prompt + k)) for k in range(tokens))
    return prompt_s, token_s


def splitwise_profile(points: list[tuple], hardware: str, degree: int) -> Profile:
    """Splitwise's measurements at one GPU and degree as a profile: prefill fitted to one prompt's times, decode to
    the batches' mean step (at their mean context); the rest from the roofline of the same GPU and degree."""
    base = roofline("llama-2-70b", SPLITWISE_GPUS[hardware], degree)
    prefill = [PrefillPoint(p, 0, ps) for p, b, _, ps, _ in points if b == 1]
    decode = [DecodePoint(b, b * (p + t // 2), ts) for p, b, t, _, ts in points]
    prefill_fit, prefill_quality = fit_points(
        ["1", "tokens", "tokens*tokens"], [{"tokens": x.tokens} for x in prefill], [x.seconds for x in prefill]
    )
    decode_fit, decode_quality = fit_points(
        DECODE_FEATURES,
        [{"batch": x.batch, "context_tokens": x.context_tokens} for x in decode],
        [x.seconds for x in decode],
    )
    return replace(
        base,
        device=f"{base.device.split(' (')[0]} (Splitwise's measurements)",
        backend="published",
        date="2023-11-30",
        prefill_points=prefill,
        decode_points=decode,
        prefill_fit=prefill_fit,
        decode_fit=decode_fit,
        notes=(
            f"MEASURED BY OTHERS: Splitwise (Patel et al., ISCA '24), Mutinifni/splitwise-sim data/perf_model.csv, "
            f"llama2-70b on {hardware} at tensor_parallel {degree}, medians of 5 repeats, batch-64 rows left out; "
            f"prefill fit {prefill_quality.describe()}, decode fit {decode_quality.describe()}; transfer fit and "
            f"KV blocks from the roofline ({base.notes.split(';')[-1].strip()}), not measured by them"
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.published_profiles", description=__doc__)
    parser.add_argument("--splitwise-csv", required=True, help="splitwise-sim's data/perf_model.csv")
    parser.add_argument("--write-profile", action="append", default=[], metavar="HARDWARE:DEGREE:OUT")
    args = parser.parse_args(argv)

    print("vLLM latency benchmark, 8 x (32 in, 128 out): median e2e ms, measured | roofline | error")
    for model, degree, gpu, build, measured, estimate, error in vllm_table():
        print(f"  {model} tp{degree} {gpu} (build {build}): {measured:.0f} | {estimate:.0f} | {error:+.1%}")
    points = splitwise_points(args.splitwise_csv)
    print("Splitwise, llama2-70b: prompt ms and ms per output token, measured | roofline | error")
    for (hardware, degree), rows in sorted(points.items()):
        profile = roofline("llama-2-70b", SPLITWISE_GPUS[hardware], degree)
        for prompt, batch, tokens, prompt_s, token_s in rows:
            est_prompt, est_token = roofline_phases(profile, prompt, batch, tokens)
            print(
                f"  {hardware} tp{degree} prompt {prompt} x{batch}: {prompt_s * 1e3:.1f} | {est_prompt * 1e3:.1f} | "
                f"{est_prompt / prompt_s - 1:+.0%};  token {token_s * 1e3:.2f} | {est_token * 1e3:.2f} | "
                f"{est_token / token_s - 1:+.0%}"
            )
    transfer = roofline("llama-3.1-70b", "h100-sxm", 4).transfer_s(MOONCAKE_BYTES)
    measured = MOONCAKE_BYTES / (MOONCAKE_GB_S_PER_NIC * 1e9)
    print(
        f"KV transfer of 40 GiB over one 200 Gb/s NIC: Mooncake {measured:.2f} s (87 GB/s over 4 NICs) | roofline "
        f"{transfer:.2f} s | {transfer / measured - 1:+.1%}"
    )
    for spec in args.write_profile:
        hardware, degree, out = spec.split(":", 2)
        profile = splitwise_profile(points[hardware, int(degree)], hardware, int(degree))
        profile.save(out)
        print(f"wrote {out}: {profile.notes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
