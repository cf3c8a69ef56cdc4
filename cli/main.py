"""The ``pdserve`` command: one entry point, one subcommand per job; heavy imports happen inside each job."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _model_tiny(args: argparse.Namespace) -> int:
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(args.out, arch=args.arch, seed=args.seed)
    print(f"tiny {args.arch} model written to {path}")
    return 0


def _bench(module_name: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        module = importlib.import_module(module_name)
        result = module.run(args)
        print(json.dumps(result, indent=None if args.json else 2))
        return 0

    return run


def _lazy(module_name: str, function: str):
    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module_name), function)(args)

    return run


def _demo(args: argparse.Namespace) -> int:
    from cluster.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    tiny = model.add_parser("tiny", help="build a deterministic tiny random-weight model for tests")
    tiny.add_argument("out")
    tiny.add_argument("--arch", choices=["llama", "qwen2"], default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_model_tiny)

    bench = sub.add_parser("bench", help="benchmarks that print JSON").add_subparsers(dest="bench_command", required=True)
    from bench import engine_bench

    engine = bench.add_parser("engine", help="engine decode/prefill throughput vs transformers generate")
    engine_bench.add_arguments(engine)
    engine.set_defaults(func=_bench("bench.engine_bench"))
    try:
        from bench import transfer_bench
    except ImportError:  # the transfer layer is optional for an engine-only install
        transfer_bench = None
    if transfer_bench is not None:
        transfer = bench.add_parser("transfer", help="KV transfer GB/s per backend vs memcpy and raw ZeroMQ")
        transfer_bench.add_arguments(transfer)
        if not any(a.dest == "json" for a in transfer._actions):
            transfer.add_argument("--json", action="store_true")
        transfer.set_defaults(func=_bench("bench.transfer_bench"))

    serve = sub.add_parser("serve", help="start the cluster and serve the OpenAI API until Ctrl-C / SIGTERM")
    serve.add_argument("--config", required=True)
    serve.add_argument("--address", default=None, help="Ray address ('auto' for a `ray up` cluster)")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument("--router-processes", type=int, default=None, metavar="N",
                       help="router (frontend) processes serving the port (default: the config's router.processes, 1)")
    serve.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                       help="require this key on /v1, /metrics and /status (default: $PDSERVE_API_KEY, else the "
                            "config's router.api_key)")
    serve.set_defaults(func=_lazy("cluster.serve", "serve"))

    status = sub.add_parser("status", help="pools, workers and their load, from a running router")
    status.add_argument("--url", default="http://127.0.0.1:8000")
    status.add_argument("--timeout", type=float, default=5.0)
    status.add_argument("--json", action="store_true")
    status.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                        help="the router's API key (default: $PDSERVE_API_KEY)")
    status.set_defaults(func=_lazy("cluster.serve", "status"))

    from bench.loadtest import cli as loadtest_cli
    from bench.loadtest import compare as loadtest_compare

    serve_bench = bench.add_parser("serve", help="load-test any OpenAI-compatible endpoint (TTFT, TPOT, ITL, goodput)")
    loadtest_cli.add_arguments(serve_bench)
    serve_bench.set_defaults(func=_bench("bench.loadtest.cli"))
    compare = bench.add_parser("compare", help="the same load against colocated and disaggregated mode")
    loadtest_compare.add_arguments(compare)
    compare.set_defaults(func=_bench("bench.loadtest.compare"))

    from bench import chaos

    chaos_bench = bench.add_parser("chaos", help="load while killing workers: lost requests and held KV must be 0")
    chaos.add_arguments(chaos_bench)
    chaos_bench.set_defaults(func=_bench("bench.chaos"))

    from bench import detok_bench  # light: the tokenizer is loaded in run()

    detok = bench.add_parser("detok", help="incremental detokenizer: microseconds per token vs stream length, against full re-decoding")
    detok_bench.add_arguments(detok)
    detok.set_defaults(func=_bench("bench.detok_bench"))

    from bench import frontend_bench  # light: the cluster runs in a subprocess, the load tester loads in run()

    frontend = bench.add_parser("frontend", help="streamed tokens per router CPU-second: tiny-model cluster, 64 streams")
    frontend_bench.add_arguments(frontend)
    frontend.set_defaults(func=_bench("bench.frontend_bench"))

    demo = sub.add_parser("demo", help="start a local cluster with the default model and chat with it")
    demo.add_argument("--config", default=None, help="default: configs/local.yaml")
    demo.add_argument("--model", default=None)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
