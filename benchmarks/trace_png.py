"""One request's trace drawn as a trace view does (a waterfall of its spans, their events as ticks), for the docs.

It serves an in-process cluster on the tiny random-weight Llama with tracing on, sends one completion with a W3C
``traceparent``, receives the spans over OTLP/HTTP (``benchmarks.otlp_receiver``) and draws them, children under their
parents, on the trace's own clock:

    python -m benchmarks.trace_png --out docs/img/trace.png [--mode disaggregated|colocated] [--prompt-tokens 200]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.otlp_receiver import OtlpReceiver, ReceivedSpan

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
EVENT_LABELS = {"first_token", "dispatched", "reserved", "start", "migration.export", "migration.frozen", "error"}


def collect(mode: str, prompt_tokens: int, max_tokens: int) -> list[ReceivedSpan]:
    """Serve one request with tracing on; its spans as the collector got them."""
    import httpx

    from cluster.config import parse_config
    from cluster.run.launch import start_serving
    from engine.tiny_model import build_tiny_model

    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "100")
    receiver = OtlpReceiver()
    try:
        with tempfile.TemporaryDirectory(prefix="trace-png-") as folder:
            model = build_tiny_model(Path(folder) / "tiny", arch="llama")
            pool = {"replicas": 1, "torch_threads": 1, "kv_blocks": 256}
            config = parse_config(
                {
                    "model": {"name": str(model), "max_model_len": 1024},
                    "mode": mode,
                    "pools": {"prefill": pool, "decode": pool},
                    "router": {"port": 0},
                    "observability": {"otlp_endpoint": receiver.endpoint},
                }
            )
            handle = start_serving(config, in_process=True)
            try:
                body = {
                    "model": handle.config.served_model_name,
                    "prompt": list(range(5, 5 + prompt_tokens)),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                response = httpx.post(
                    f"{handle.base_url}/v1/completions", json=body, headers={"traceparent": TRACEPARENT}, timeout=120
                )
                response.raise_for_status()
                names = {"POST /v1/completions", "pdserve.route"}
                names |= {"pdserve.prefill", "pdserve.decode"} if mode == "disaggregated" else {"pdserve.generate"}
                return receiver.wait_for(lambda spans: names <= {s.name for s in spans}, timeout_s=30)
            finally:
                handle.stop()
    finally:
        receiver.close()


def _ordered(spans: list[ReceivedSpan]) -> list[tuple[int, ReceivedSpan]]:
    """Depth-first from the roots, children by start time: (depth, span)."""
    children: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for span in spans:
        children.setdefault(span.parent_span_id if span.parent_span_id in ids else "", []).append(span)
    out: list[tuple[int, ReceivedSpan]] = []

    def walk(parent: str, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: s.start_ns):
            out.append((depth, span))
            walk(span.span_id, depth + 1)

    walk("", 0)
    return out


def draw(spans: list[ReceivedSpan], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _ordered([s for s in spans if s.trace_id == TRACE_ID])
    origin = min(s.start_ns for _, s in rows)
    fig, ax = plt.subplots(figsize=(12, 0.55 * len(rows) + 1.4))
    colours = {"router": "#4c72b0", "prefill": "#dd8452", "decode": "#55a868", "colocated": "#8172b2"}
    for row, (depth, span) in enumerate(rows):
        component = str(span.resource.get("pdserve.component", ""))
        kind = next((k for k in colours if component.startswith(k)), "colocated")
        start_ms, end_ms = (span.start_ns - origin) / 1e6, (span.end_ns - origin) / 1e6
        ax.barh(row, max(end_ms - start_ms, 0.05), left=start_ms, color=colours[kind], height=0.6)
        ax.text(
            -0.01,
            row,
            f"{'  ' * depth}{span.name}  [{component}]",
            transform=ax.get_yaxis_transform(),
            ha="right",
            va="center",
            fontsize=8,
        )
        ax.text(end_ms, row, f" {end_ms - start_ms:.1f} ms", va="center", fontsize=7)
        for (name, _), at_ns in zip(span.events, span.event_times_ns, strict=True):
            if name in EVENT_LABELS or name == "kv.layer_sent":
                at_ms = (at_ns - origin) / 1e6
                ax.plot([at_ms, at_ms], [row - 0.3, row + 0.3], color="black", linewidth=0.8)
                if name in EVENT_LABELS:
                    ax.text(at_ms, row - 0.36, name, fontsize=6, ha="center", va="bottom")
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the request arrived")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_png", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img/trace.png"))
    parser.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    spans = collect(args.mode, args.prompt_tokens, args.max_tokens)
    from engine.cpu_info import cpu_model

    title = (
        f"one {args.mode} request ({args.prompt_tokens} prompt tokens, {args.max_tokens} out), tiny random Llama, "
        f"in-process cluster, {cpu_model().split(';')[0]}"
    )
    draw(spans, args.out, title)
    rows = _ordered([s for s in spans if s.trace_id == TRACE_ID])
    origin = min(s.start_ns for _, s in rows)
    summary = [
        {
            "name": s.name,
            "component": s.resource.get("pdserve.component"),
            "start_ms": round((s.start_ns - origin) / 1e6, 2),
            "ms": round((s.end_ns - s.start_ns) / 1e6, 2),
            "events": [[name, round((at - origin) / 1e6, 2)] for (name, _), at in zip(s.events, s.event_times_ns)],
            "attributes": {k: v for k, v in s.attributes.items() if k.startswith(("pdserve.kv", "pdserve.timing.t"))},
        }
        for _, s in rows
    ]
    print(json.dumps({"out": str(args.out), "cpu": cpu_model(), "spans": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
