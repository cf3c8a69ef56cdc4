"""Command-line options of the product's benchmarks whose modules are heavy to import: the hardware self-checks
(``pdserve bench engine``, ``bench transfer``) and the load tester's ``compare`` and ``plot``.

``pdserve bench ...`` must not import torch, transformers or Ray to list options, so this module imports ``argparse``
and the load tester's options only; each benchmark imports its function as ``add_arguments``. The experiments'
options (benchmarks/options.py) are declared outside the package. pdserve's own values are plain here, checked by
``tests/bench/loadtest/test_imports.py``.
"""

from __future__ import annotations

import argparse

from bench.loadtest.options import PDSERVE_DEFAULT_MODEL, add_workload_arguments

TRANSFER_BACKENDS = ("zmq-tcp", "zmq-ipc", "shm", "shm-direct", "gloo", "local")
COMPARE_MODES = ("colocated", "disaggregated")


def add_engine_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench engine`` (``bench/engine_bench.py``)."""
    parser.add_argument("--model", default=PDSERVE_DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None, help="default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "flex", "flashinfer"])
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="CPU: skip the compiled decode step's row (compile_decode_batches: one compile per batch size, ~35 s)",
    )


def add_transfer_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench transfer`` (``bench/transfer_bench.py``)."""
    parser.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=[1, 16, 64],
        help="KV payload sizes in MiB (rounded to whole blocks)",
    )
    parser.add_argument("--backends", nargs="+", default=list(TRANSFER_BACKENDS), choices=TRANSFER_BACKENDS)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    parser.add_argument("--no-checksum", action="store_true", help="disable xxh3 frame checksums")


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench compare`` (``bench/compare_modes.py``): a cluster config, the modes, a workload."""
    parser.add_argument("--config", required=True, help="cluster YAML (configs/local.yaml)")
    parser.add_argument("--modes", default=",".join(COMPARE_MODES), help="which modes to run, in order")
    add_workload_arguments(parser)


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench plot`` (``bench/loadtest/plots.py``)."""
    parser.add_argument("result_dir", help="a folder written by `pdserve bench serve` or `pdserve bench compare`")
