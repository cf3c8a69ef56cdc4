"""Command-line options of the product's benchmarks whose modules are heavy to import: the hardware self-checks
(``pdserve bench engine``, ``bench transfer``) and the load tester's ``compare`` and ``plot``.

``pdserve bench ...`` must not import torch, transformers or Ray to list options, so this module imports ``argparse``
and the load tester's options only; each benchmark imports its function as ``add_arguments``. pdserve's own values
are plain here, checked by ``tests/bench/loadtest/test_imports.py``.

Three flags of the self-checks run an experiment of the source checkout (benchmarks/) instead of, or after, the
self-check, as they did before the experiments left bench/: ``bench engine --speculative ngram`` (the experiment
``bench speculative``), ``bench transfer --degrees`` (``bench tp-handoff``) and ``bench transfer --overlap``
(``bench overlap``, its options under ``--overlap-``). Their options are declared here, once, for both spellings
(benchmarks/options.py and benchmarks/overlap_bench.py take them from here: benchmarks/ may import the product,
never the reverse), and so are the functions that turn a self-check's arguments into the experiment's
(``engine_bench_defaults``, ``overlap_arguments``); cli/main.py's ``ROUTES`` sends the flags there.
"""

from __future__ import annotations

import argparse

from bench.loadtest.options import PDSERVE_DEFAULT_MODEL, add_workload_arguments

TRANSFER_BACKENDS = ("zmq-tcp", "zmq-ipc", "shm", "shm-direct", "gloo", "local")
COMPARE_MODES = ("colocated", "disaggregated")
SPECULATIVE_METHODS = ("ngram",)
# --batch-sizes and --output-len left out: the engine bench's, and the speculative experiment's (bench speculative,
# or bench engine --speculative)
ENGINE_DEFAULTS = {"batch_sizes": "1,8,32", "output_len": 32}
SPECULATIVE_DEFAULTS = {"batch_sizes": "1,8", "output_len": 96}
TP_HANDOFF_DEGREES = "1:1,2:1,1:2,2:2"
OVERLAP_PREFIX = "overlap-"  # bench transfer --overlap: the overlap options are --overlap-config, ...
INT8_CHECK_PROMPTS = 20  # len(benchmarks/overlap_bench.py's CHAT_PROMPTS) (tests/benchmarks/test_overlap_bench.py)


def add_engine_run_arguments(parser: argparse.ArgumentParser, defaults: dict[str, object] | None = None) -> None:
    """What the engine bench and the speculative experiment both take: the model, its batches and lengths, the
    repeats. ``defaults``: those of --batch-sizes and --output-len; None (the engine bench): left unset, so that
    ``engine_bench_defaults`` picks them by --speculative."""
    spelled = {
        name: (
            f"default: {ENGINE_DEFAULTS[name]} (with --speculative: {SPECULATIVE_DEFAULTS[name]})"
            if defaults is None
            else None
        )
        for name in ENGINE_DEFAULTS
    }
    chosen = defaults or {}
    parser.add_argument("--model", default=PDSERVE_DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None, help="default: cuda when torch sees a GPU, else cpu")
    parser.add_argument("--batch-sizes", default=chosen.get("batch_sizes"), help=spelled["batch_sizes"])
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=chosen.get("output_len"), help=spelled["output_len"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print only the JSON object")


def engine_bench_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with --batch-sizes and --output-len filled in where left out: the engine bench's (1,8,32 and 32), or
    with --speculative the speculative experiment's (1,8 and 96), as bench engine always had them."""
    defaults = SPECULATIVE_DEFAULTS if getattr(args, "speculative", None) else ENGINE_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return args


def add_speculative_arguments(parser: argparse.ArgumentParser, embedded: bool = False) -> None:
    """The speculative experiment's own options: ``bench speculative --method ngram`` (the default), or, ``embedded``
    in the engine bench, ``bench engine --speculative ngram`` (off unless given; the rest apply with it)."""
    with_it = "with --speculative: " if embedded else ""
    if embedded:
        parser.add_argument(
            "--speculative",
            choices=SPECULATIVE_METHODS,
            default=None,
            help="measure speculative decoding instead (benchmarks/speculative_bench.py, from a source checkout; "
            "`pdserve bench speculative`): against the same engine without it, transformers' prompt lookup and "
            "plain generate, on grounded and random prompts",
        )
    else:
        parser.add_argument(
            "--method",
            dest="speculative",
            choices=SPECULATIVE_METHODS,
            default=SPECULATIVE_METHODS[0],
            help="the engine's speculative.method",
        )
    parser.add_argument("--num-spec-tokens", type=int, default=4, help=f"{with_it}proposed tokens per step")
    parser.add_argument("--ngram-max", type=int, default=3, help=f"{with_it}the longest n-gram looked up")
    parser.add_argument("--batch1-prompts", type=int, default=4, help=f"{with_it}prompts run one at a time")
    parser.add_argument(
        "--compile-batches",
        default=None,
        help=f"{with_it}the engine's compile_decode_batches (e.g. 1,2,4,8,16: a verification's tokens are rows of "
        "the compiled step); default: eager",
    )
    parser.add_argument(
        "--prompt-sets",
        default="grounded,random,random_sampled",
        help=f"{with_it}which prompt sets to run (comma-separated)",
    )


def add_engine_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench engine`` (``bench/engine_bench.py``), and its ``--speculative`` experiment."""
    add_engine_run_arguments(parser)
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "flex", "flashinfer"])
    parser.add_argument(
        "--no-compiled",
        action="store_true",
        help="CPU: skip the compiled decode step's row (compile_decode_batches: one compile per batch size, ~35 s)",
    )
    add_speculative_arguments(parser, embedded=True)


def add_reps_argument(parser: argparse.ArgumentParser) -> None:
    """--reps of the transfer bench, which its --degrees experiment (the tensor-parallel hand-off) takes too."""
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")


def add_tp_handoff_arguments(parser: argparse.ArgumentParser, embedded: bool = False) -> None:
    """The tensor-parallel hand-off experiment's own options (``bench tp-handoff``; --reps is the transfer bench's):
    ``embedded`` in the transfer bench, --degrees is off unless given and the rest apply with it."""
    with_it = "with --degrees: " if embedded else ""
    what = "the KV hand-off from a prefill engine of P tensor-parallel ranks to a decode engine of D"
    if embedded:
        what = (
            f"instead: {what} (benchmarks/tp_handoff_bench.py, from a source checkout; `pdserve bench tp-handoff`), "
            f"e.g. {TP_HANDOFF_DEGREES}"
        )
    parser.add_argument("--degrees", default=None if embedded else TP_HANDOFF_DEGREES, metavar="P:D,...", help=what)
    parser.add_argument(
        "--handoff-backend", default="zmq", choices=["zmq", "shm", "gloo"], help=f"{with_it}the transfer backend"
    )
    parser.add_argument("--requests", type=int, default=4, help=f"{with_it}prompts prefilled per step")
    parser.add_argument("--prompt-len", type=int, default=256, help=f"{with_it}tokens per prompt")


def add_overlap_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The overlap experiment's options (``bench overlap``). ``prefix`` (``OVERLAP_PREFIX``) namespaces them when the
    transfer bench embeds it (``bench transfer --overlap``): --overlap-config, ...; there the int8 wire check runs
    unless --overlap-no-int8, and --model and --no-overlap are not offered."""
    p = prefix
    d = p.replace("-", "_")
    parser.add_argument(
        f"--{p}config",
        dest=f"{d}config",
        default="local",
        help="cluster config the runs start from: a path or a shipped name (default: local)",
    )
    if not p:
        parser.add_argument("--model", default=None, help="override model.name (a folder, or the built-in default)")
    parser.add_argument(f"--{p}prompt-tokens", dest=f"{d}prompt_tokens", type=int, default=1024)
    parser.add_argument(
        f"--{p}reps",
        dest=f"{d}reps",
        type=int,
        default=5,
        help="timed requests per mode (median reported), after one discarded warm-up",
    )
    parser.add_argument(f"--{p}max-tokens", dest=f"{d}max_tokens", type=int, default=4)
    parser.add_argument(
        f"--{p}prefill-chunk",
        dest=f"{d}prefill_chunk",
        type=int,
        default=None,
        help="pools.prefill.max_batch_tokens (the prefill chunk); default: the config's",
    )
    if p:
        parser.add_argument(
            f"--{p}no-int8",
            dest=f"{d}no_int8",
            action="store_true",
            help="skip the int8 wire check (raw vs int8 greedy outputs)",
        )
    else:
        parser.add_argument("--no-overlap", action="store_true", help="skip the overlap measurement")
        parser.add_argument(
            "--int8-check",
            action="store_true",
            help="also compare greedy outputs with kv_wire_dtype raw vs int8 (one more cluster start)",
        )
    parser.add_argument("--int8-prompts", type=int, default=INT8_CHECK_PROMPTS, help=f"at most {INT8_CHECK_PROMPTS}")
    parser.add_argument("--int8-tokens", type=int, default=64)
    if not p:
        parser.add_argument("--json", action="store_true", help="print the JSON object on one line")


def overlap_arguments(args: argparse.Namespace, prefix: str = OVERLAP_PREFIX) -> argparse.Namespace:
    """The overlap options ``add_overlap_arguments(prefix=...)`` parsed, as ``bench overlap`` would have them: the
    embedded form's int8 check (on unless --overlap-no-int8) is --int8-check; the overlap is always measured and the
    config's model used."""
    d = prefix.replace("-", "_")
    prefixed = ("config", "prompt_tokens", "reps", "max_tokens", "prefill_chunk")
    return argparse.Namespace(
        **{name: getattr(args, f"{d}{name}") for name in prefixed},
        model=None,
        no_overlap=False,
        int8_check=not getattr(args, f"{d}no_int8"),
        int8_prompts=args.int8_prompts,
        int8_tokens=args.int8_tokens,
        json=getattr(args, "json", False),
    )


def add_transfer_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench transfer`` (``bench/transfer_bench.py``), and its experiments: --overlap (with the overlap
    options under ``--overlap-``) and --degrees."""
    parser.add_argument(
        "--sizes-mib",
        type=float,
        nargs="+",
        default=[1, 16, 64],
        help="KV payload sizes in MiB (rounded to whole blocks)",
    )
    parser.add_argument("--backends", nargs="+", default=list(TRANSFER_BACKENDS), choices=TRANSFER_BACKENDS)
    add_reps_argument(parser)
    parser.add_argument("--no-checksum", action="store_true", help="disable xxh3 frame checksums")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="also start the served cluster (SmolLM2) and measure how much of the transfer streaming hides behind "
        "the prefill, and the int8 wire check (takes minutes; benchmarks/overlap_bench.py, from a source checkout: "
        '`pdserve bench overlap` on its own); its figures under "overlap"',
    )
    add_overlap_arguments(parser, prefix=OVERLAP_PREFIX)
    add_tp_handoff_arguments(parser, embedded=True)


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench compare`` (``bench/compare_modes.py``): a cluster config, the modes, a workload."""
    parser.add_argument("--config", required=True, help="cluster YAML (configs/local.yaml)")
    parser.add_argument("--modes", default=",".join(COMPARE_MODES), help="which modes to run, in order")
    add_workload_arguments(parser)


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """``pdserve bench plot`` (``bench/loadtest/plots.py``)."""
    parser.add_argument("result_dir", help="a folder written by `pdserve bench serve` or `pdserve bench compare`")
