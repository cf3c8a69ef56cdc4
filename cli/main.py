"""The ``pdserve`` command: one entry point, one subcommand per job.

``pdserve --help`` and ``pdserve status`` must start at once without torch, so this module imports the standard
library only: each subcommand names its module as a string, imported when it runs, and a benchmark's options come
from a light module (``bench/options.py``, ``bench/loadtest/options.py``, ``benchmarks/options.py`` or the benchmark
itself), declared only when that benchmark is the command being parsed (``LazyOptionsParser``).

``pdserve bench`` runs the product's benchmarks (``BENCHMARKS``: the load tester and the hardware self-checks, in the
package) and the experiments behind docs/benchmarks*.md (``EXPERIMENTS``: benchmarks/, a folder of the source
checkout that the package does not hold). Three flags of the self-checks reach an experiment too, as they did before
the experiments left bench/ (``ROUTES``: ``bench engine --speculative``, ``bench transfer --degrees`` and
``--overlap``). ``_experiment`` is the product's one import of benchmarks/.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple, NoReturn

from cli import plan_cmd, plan_kv_cmd, plan_shift_cmd, plan_validate_cmd, profile_cmd, role_cmd, scale_cmd, sim_cmd
from cli import status as status_command

Command = Callable[[argparse.Namespace], int]

# ``pdserve model tiny --arch``: engine.tiny_model.TINY_ARCHITECTURES, named here without importing torch (a test
# keeps the two equal)
TINY_ARCHITECTURE_NAMES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "cohere", "mixtral", "qwen3_moe",
    "gpt_oss", "deepseek_v3",
]  # fmt: skip
# (subcommand, options module, its function, run module, help); options modules import nothing heavy (test_startup.py)
# fmt: off
BENCHMARKS: list[tuple[str, str, str, str, str]] = [
    ("engine", "bench.options", "add_engine_bench_arguments", "bench.engine_bench",
     "engine decode/prefill throughput vs transformers generate"),
    ("transfer", "bench.options", "add_transfer_bench_arguments", "bench.transfer_bench",
     "KV transfer GB/s per backend vs memcpy and raw ZeroMQ"),
    ("serve", "bench.loadtest.options", "add_arguments", "bench.loadtest.cli",
     "load-test any OpenAI-compatible endpoint (TTFT, TPOT, ITL, goodput)"),
    ("compare", "bench.options", "add_compare_arguments", "bench.compare_modes",
     "the same load against colocated and disaggregated mode"),
    ("plot", "bench.options", "add_plot_arguments", "bench.loadtest.plots",
     "redraw a results folder's plots (serve, compare) from its summary.json and requests.jsonl"),
]
# The experiments, the same columns with module names inside benchmarks/ (source checkout only: ``_experiment``)
EXPERIMENTS: list[tuple[str, str, str, str, str]] = [
    ("tp", "tp_bench", "add_arguments", "tp_bench",
     "prefill and decode step time per tensor-parallel degree, same total threads (CPU: correctness, not speed)"),
    ("tp-handoff", "options", "add_tp_handoff_bench_arguments", "tp_handoff_bench",
     "the KV hand-off from a prefill engine of P tensor-parallel ranks to a decode engine of D"),
    ("overlap", "overlap_bench", "add_arguments", "overlap_bench",
     "how much of the KV transfer streaming hides behind the prefill (served cluster), and the int8 wire check"),
    ("speculative", "options", "add_speculative_bench_arguments", "speculative_bench",
     "n-gram speculative decoding vs none, transformers' prompt lookup and generate"),
    ("routing", "options", "add_routing_bench_arguments", "routing_bench",
     "kv_aware routing and prefix reuse vs least_loaded: TTFT, KV bytes per request, prefix hit rate"),
    ("chaos", "options", "add_chaos_arguments", "chaos",
     "load while killing workers: lost requests and held KV must be 0"),
    ("detok", "detok_bench", "add_arguments", "detok_bench",
     "incremental detokenizer: microseconds per token vs stream length, against full re-decoding"),
    ("frontend", "frontend_bench", "add_arguments", "frontend_bench",
     "streamed tokens per router CPU-second: tiny-model cluster, 64 streams"),
    ("models", "options", "add_model_families_bench_arguments", "model_families_bench",
     "every model family on tiny random weights: token-exact vs transformers, features, KV bytes, decode tokens/s"),
    ("kv-cache", "options", "add_kv_cache_bench_arguments", "kv_quant_bench",
     "quantized KV cache (int8, fp8_e4m3) against the model's dtype: tokens per GiB, greedy agreement, decode speed"),
    ("kv-tiers", "options", "add_kv_tiers_bench_arguments", "kv_tiers_bench",
     "KV tiers (host memory, disk) vs none under a multi-tenant shared-prefix load: TTFT, hit rate, a restart"),
    ("migrate", "options", "add_migration_bench_arguments", "migration_bench",
     "live migration: a decode worker's streams drained by moving vs by waiting; rebalancing vs preemption"),
    ("stranger", "options", "add_stranger_bench_arguments", "stranger_bench",
     "a process without the cluster's keys attacks every socket: memory it moves, handshakes refused, served after"),
    ("role-switch", "options", "add_role_switch_bench_arguments", "role_switch_bench",
     "a worker switching between prefill and decode in place against replacing it (stop one, start one)"),
    ("role-shift", "options", "add_role_shift_bench_arguments", "role_shift_bench",
     "a trace whose mix shifts: a fixed split against autoscaling by restarts and by role switches (goodput)"),
]
# fmt: on


class Route(NamedTuple):
    """A flag of a product benchmark that runs an experiment (one of ``EXPERIMENTS``) instead of the benchmark, or
    after it with its result nested in the benchmark's."""

    benchmark: str  # BENCHMARKS' name
    flag: str  # the flag's dest: set (not None, not False) sends the command to the experiment
    experiment: str  # EXPERIMENTS' name
    adapt: str | None  # a function of the benchmark's options module: its arguments -> the experiment's (None: as is)
    nested: str | None  # the key of the benchmark's result the experiment's goes under (None: it runs instead)


# bench engine and bench transfer keep the flags they had before the experiments left bench/ (issue 50: no flag a
# user sees goes); the options are declared once, in bench/options.py, for them and for the experiments' subcommands
ROUTES: list[Route] = [
    Route("engine", "speculative", "speculative", "engine_bench_defaults", None),
    Route("transfer", "degrees", "tp-handoff", None, None),
    Route("transfer", "overlap", "overlap", "overlap_arguments", "overlap"),
]
# an experiment's (options module, run module) inside benchmarks/, by its name
EXPERIMENT_MODULES = {name: (options, run) for name, options, _, run, _ in EXPERIMENTS}
# the source checkout this cli/ runs from (an editable install's, or the working directory's); in an installed wheel
# it is site-packages, which holds no benchmarks/
CHECKOUT = Path(__file__).resolve().parent.parent


class NoCheckout(Exception):
    """An experiment was asked for where no source checkout holds benchmarks/ (an installed wheel)."""


def _experiment(module: str) -> ModuleType:
    """``benchmarks.<module>`` of the source checkout: the one import of benchmarks/ in the product, made only when
    an experiment's subcommand is parsed or run (tests/test_layers.py holds every other module to none)."""
    if not (CHECKOUT / "pyproject.toml").is_file() or not (CHECKOUT / "benchmarks" / "__init__.py").is_file():
        raise NoCheckout(str(CHECKOUT))
    if str(CHECKOUT) not in sys.path:  # first: this checkout's benchmarks/, in processes it spawns too
        sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module(f"benchmarks.{module}")


class LazyOptionsParser(argparse.ArgumentParser):
    """A subcommand's parser that declares its options on first parse or help: argparse parses with the chosen
    subcommand's parser only, so only that one imports its options module."""

    def __init__(
        self,
        *args: Any,
        declare: Callable[[argparse.ArgumentParser], None] | None = None,
        check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._declare = declare
        self._check = check  # of the parsed arguments, before the command runs (it may call self.error)

    def _declare_once(self) -> None:
        if self._declare is not None:
            declare, self._declare = self._declare, None
            declare(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self._declare_once()
        parsed, extras = super().parse_known_args(args, namespace)
        if self._check is not None:
            self._check(self, parsed)
        return parsed, extras

    def format_help(self) -> str:
        self._declare_once()
        return super().format_help()

    def format_usage(self) -> str:
        self._declare_once()
        return super().format_usage()


def _call(module_name: str, function: str) -> Command:
    """``module_name.function(args)``, imported only when it runs."""

    def run(args: argparse.Namespace) -> int:
        return int(getattr(importlib.import_module(module_name), function)(args))

    return run


def _convert_builtin_model(args: argparse.Namespace) -> None:
    """The load tester takes the tokenizer of pdserve's built-in model from where pdserve converts it, importing
    nothing of pdserve; on a machine that never served it, the CLI converts it first (once, about 20 s), as
    ``pdserve serve`` would, unless a ``--tokenizer`` or a model folder is given."""
    if args.tokenizer:
        return
    if args.bench_command == "compare":
        from cluster.config import load_config

        model = load_config(args.config).model.name
    else:
        model = args.model
    if model and Path(model).expanduser().is_dir():
        return
    from bench.loadtest.options import PDSERVE_DEFAULT_MODEL
    from bench.loadtest.workloads import pdserve_model_folder

    if not (pdserve_model_folder(PDSERVE_DEFAULT_MODEL) / "config.json").is_file():
        from engine.model_loader import resolve_model_path  # torch: only on a machine that has not converted it

        resolve_model_path(PDSERVE_DEFAULT_MODEL)


def _benchmark(
    load: Callable[[], ModuleType], options: Callable[[], ModuleType] | None = None, routes: list[Route] | None = None
) -> Command:
    """A benchmark command: ``module.run(args)`` returns a dict, printed as JSON (one line with ``--json``). With
    ``routes`` (a product benchmark's ``ROUTES``), a flag that is set runs its experiment instead, or after it."""

    def run(args: argparse.Namespace) -> int:
        if getattr(args, "bench_command", None) in ("serve", "compare"):
            _convert_builtin_model(args)
        chosen = [route for route in routes or [] if getattr(args, route.flag, None)]
        instead = next((route for route in chosen if route.nested is None), None)
        if instead is not None:
            result = _run_experiment(instead, options, args)
        else:
            result = load().run(args)
            for route in chosen:
                assert route.nested is not None
                result[route.nested] = _run_experiment(route, options, args)
        if isinstance(result, dict) and "cpu" not in result:  # every CPU figure is read against its CPU
            from engine.cpu_info import cpu_model

            result = {"cpu": cpu_model(), **result}
        print(json.dumps(result, indent=None if args.json else 2))
        return 0

    return run


def _run_experiment(route: Route, options: Callable[[], ModuleType] | None, args: argparse.Namespace) -> Any:
    """The experiment a product flag reaches, on the benchmark's arguments (``route.adapt`` of them)."""
    _, run_module = EXPERIMENT_MODULES[route.experiment]
    if route.adapt is not None:
        assert options is not None
        args = getattr(options(), route.adapt)(args)
    return _experiment(run_module).run(args)


def _routes_check(routes: list[Route]) -> Callable[[argparse.ArgumentParser, argparse.Namespace], None]:
    """A product flag that reaches an experiment, where no checkout holds benchmarks/: the experiment's error, at
    once (its light options module loaded, as its own subcommand's parsing does; not the experiment)."""

    def check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        for route in routes:
            if getattr(args, route.flag, None):
                options_module, run_module = EXPERIMENT_MODULES[route.experiment]
                try:
                    _experiment(options_module)
                except NoCheckout as exc:
                    _no_checkout(parser, exc, run_module, f"{parser.prog} --{route.flag.replace('_', '-')}")

    return check


def _no_checkout(parser: argparse.ArgumentParser, exc: NoCheckout, run_module: str, command: str) -> NoReturn:
    parser.error(
        f"an experiment of pdserve's source checkout (benchmarks/{run_module}.py), which this installation "
        f"({exc}) does not hold: run it from a checkout of the repository, as `{command}` or "
        f"`python -m benchmarks.{run_module}` from its root"
    )


def _options(
    load: Callable[[], ModuleType], function: str, run_module: str
) -> Callable[[argparse.ArgumentParser], None]:
    """Every benchmark takes ``--json``, whether or not its options module declares it."""

    def declare(parser: argparse.ArgumentParser) -> None:
        try:
            module = load()
        except NoCheckout as exc:
            _no_checkout(parser, exc, run_module, parser.prog)
        getattr(module, function)(parser)
        if not any(action.dest == "json" for action in parser._actions):
            parser.add_argument("--json", action="store_true", help="print the JSON object on one line")

    return declare


def _add_bench(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks that print JSON",
        description="The load tester and hardware self-checks (engine, transfer, serve, compare, plot), and the "
        "experiments behind docs/benchmarks*.md (the others: from a source checkout only, benchmarks/).",
    )
    benchmarks = bench.add_subparsers(dest="bench_command", required=True, parser_class=LazyOptionsParser)
    loaders: list[tuple[list[tuple[str, str, str, str, str]], Callable[[str], ModuleType]]] = [
        (BENCHMARKS, importlib.import_module),
        (EXPERIMENTS, _experiment),
    ]
    for table, load in loaders:
        for name, options_module, options_function, run_module, help_text in table:
            options = functools.partial(load, options_module)
            declare = _options(options, options_function, run_module)
            routes = [route for route in ROUTES if route.benchmark == name] if table is BENCHMARKS else []
            check = _routes_check(routes) if routes else None
            parser = benchmarks.add_parser(name, help=help_text, declare=declare, check=check)
            parser.set_defaults(func=_benchmark(functools.partial(load, run_module), options, routes))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    api_key = os.environ.get("PDSERVE_API_KEY")

    model = sub.add_parser("model", help="model utilities").add_subparsers(dest="model_command", required=True)
    tiny = model.add_parser("tiny", help="build a deterministic tiny random-weight model for tests")
    tiny.add_argument("out")
    tiny.add_argument("--arch", choices=TINY_ARCHITECTURE_NAMES, default="llama")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_call("cli.model", "tiny"))

    _add_bench(sub)

    serve = sub.add_parser("serve", help="start the cluster and serve the OpenAI API until Ctrl-C / SIGTERM")
    serve.add_argument("--config", required=True, help="a YAML file, or the name of a shipped config (local, gpu-node)")
    serve.add_argument("--address", default=None, help="Ray address ('auto' for a `ray up` cluster)")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument(
        "--router-processes",
        type=int,
        default=None,
        metavar="N",
        help="router (frontend) processes serving the port (default: the config's router.processes, 1)",
    )
    serve.add_argument(
        "--api-key",
        default=api_key,
        help="require this key on /v1, /metrics and /status (default: $PDSERVE_API_KEY, else the "
        "config's router.api_key)",
    )
    serve.set_defaults(func=_call("cli.serve_cmd", "run"))

    status = sub.add_parser("status", help="pools, workers and their load, from a running router")
    status_command.add_arguments(status, default_api_key=api_key)
    status.set_defaults(func=status_command.status)

    scale = sub.add_parser("scale", help="resize a pool of a running cluster (new workers join, removed ones drain)")
    scale_cmd.add_arguments(scale, default_api_key=api_key)
    scale.set_defaults(func=_call("cli.scale_cmd", "run"))

    role = sub.add_parser(
        "role", help="switch a worker of a running cluster between prefill and decode in place (its weights kept)"
    )
    role_cmd.add_arguments(role, default_api_key=api_key)
    role.set_defaults(func=_call("cli.role_cmd", "run"))

    demo = sub.add_parser("demo", help="start a local cluster with the default model and chat with it")
    demo.add_argument("--config", default=None, help="default: the shipped local config (configs/local.yaml)")
    demo.add_argument("--model", default=None)
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.set_defaults(func=_call("cluster.run.demo", "run_demo"))

    sim = sub.add_parser(
        "sim",
        help="the cluster protocol in a seeded simulation with faults: run seeds, or replay one (exit 1: violation)",
    )
    sim_cmd.add_arguments(sim)
    sim.set_defaults(func=_call("cli.sim_cmd", "run"))

    profile = sub.add_parser(
        "profile", help="measure prefill, decode and KV transfer times on this hardware (the input of `plan`)"
    )
    profile_cmd.add_arguments(profile)
    profile.set_defaults(func=_call("cli.profile_cmd", "run"))

    plan = sub.add_parser(
        "plan", help="simulate colocated and every P:D split for an SLO and recommend one (plan kv: KV sizing)"
    )
    plan_cmd.add_arguments(plan)
    plan.set_defaults(func=_call("cli.plan_cmd", "run"))
    plan_sub = plan.add_subparsers(dest="plan_command", required=False)
    plan_kv = plan_sub.add_parser("kv", help="KV bytes per token, tokens per GiB, requests that fit")
    plan_kv_cmd.add_arguments(plan_kv)
    plan_kv.set_defaults(func=_call("cli.plan_kv_cmd", "run"))
    validate = plan_sub.add_parser(
        "validate", help="run a workload on the local cluster and through the simulator; print both side by side"
    )
    plan_validate_cmd.add_arguments(validate)
    validate.set_defaults(func=_call("cli.plan_validate_cmd", "run"))
    shift = plan_sub.add_parser(
        "shift", help="a trace whose mix shifts: the fixed split against the autoscaler moving workers by role switches"
    )
    plan_shift_cmd.add_arguments(shift)
    shift.set_defaults(func=_call("cli.plan_shift_cmd", "run"))

    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.func(args))
    except ValueError as exc:  # bad input: a clear message, not a traceback
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
