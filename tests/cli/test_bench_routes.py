"""The self-checks' flags that reach an experiment (cli/main.py's ``ROUTES``) parse as they did before the experiments
left bench/ and hand the experiment's ``run`` the options its own subcommand would: ``bench engine --speculative
ngram`` (``bench speculative``), ``bench transfer --degrees`` (``bench tp-handoff``) and ``bench transfer --overlap``
(``bench overlap``, its result under "overlap"). The experiments' ``run`` is replaced by one that records its
arguments: no model, no cluster."""

from __future__ import annotations

import argparse
import importlib
import json
from typing import Any

import pytest

import cli.main as cli_main
from bench import options as bench_options
from cli.main import BENCHMARKS, EXPERIMENT_MODULES, EXPERIMENTS, ROUTES, build_parser, main

PARSER_ONLY = {"command", "bench_command", "func", "verbose"}  # what the pdserve parser adds to a benchmark's own


def _record(monkeypatch, module: Any, result: dict[str, Any]) -> list[argparse.Namespace]:
    """Replace ``module.run`` by one that records its arguments and returns ``result``."""
    calls: list[argparse.Namespace] = []

    def run(args: argparse.Namespace) -> dict[str, Any]:
        calls.append(args)
        return dict(result)

    monkeypatch.setattr(module, "run", run)
    return calls


def _refuse(monkeypatch, module: Any) -> None:
    def run(args: argparse.Namespace) -> dict[str, Any]:
        raise AssertionError(f"{module.__name__}.run ran")

    monkeypatch.setattr(module, "run", run)


def _subcommand(*argv: str) -> dict[str, Any]:
    """What ``pdserve ARGV`` parses, less the parser's own keys."""
    return {k: v for k, v in vars(build_parser().parse_args(list(argv))).items() if k not in PARSER_ONLY}


def _printed(capsys) -> dict[str, Any]:
    """The JSON a benchmark printed, less the CPU it names (every benchmark's does: ``cli.main`` adds it)."""
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert isinstance(printed.pop("cpu"), str)
    return printed


# ---- bench engine --speculative ngram -------------------------------------------------------------------------------


def test_engine_speculative_runs_the_speculative_experiment_with_the_old_defaults(monkeypatch, capsys):
    from bench import engine_bench
    from benchmarks import speculative_bench

    calls = _record(monkeypatch, speculative_bench, {"speculative": {"method": "ngram"}})
    _refuse(monkeypatch, engine_bench)
    assert main(["bench", "engine", "--speculative", "ngram", "--json", "--model", "m"]) == 0
    assert _printed(capsys) == {"speculative": {"method": "ngram"}}
    (args,) = calls
    # --batch-sizes and --output-len left out: the speculative experiment's defaults, as bench engine had them
    assert (args.batch_sizes, args.output_len) == ("1,8", 96)
    assert args.speculative == "ngram" and args.model == "m"
    assert (args.num_spec_tokens, args.ngram_max, args.batch1_prompts) == (4, 3, 4)
    assert args.compile_batches is None and args.prompt_sets == "grounded,random,random_sampled"


def test_engine_speculative_takes_every_old_option_as_bench_speculative_does(monkeypatch, capsys):
    from benchmarks import speculative_bench

    calls = _record(monkeypatch, speculative_bench, {})
    shared = ["--model", "m", "--batch-sizes", "1,2", "--output-len", "6", "--input-len", "12", "--repeats", "1"]
    shared += ["--num-spec-tokens", "5", "--ngram-max", "2", "--batch1-prompts", "2", "--compile-batches", "1,2"]
    shared += ["--prompt-sets", "grounded", "--json", "--dtype", "bfloat16", "--device", "cpu"]
    assert main(["bench", "engine", "--speculative", "ngram", *shared]) == 0
    (args,) = calls
    expected = _subcommand("bench", "speculative", "--method", "ngram", *shared)
    assert {k: v for k, v in vars(args).items() if k in expected} == expected
    assert args.compile_batches == "1,2" and args.num_spec_tokens == 5 and args.output_len == 6


def test_engine_without_speculative_keeps_its_own_defaults():
    args = build_parser().parse_args(["bench", "engine"])
    assert args.speculative is None and args.batch_sizes is None and args.output_len is None  # picked at run time
    bench_options.engine_bench_defaults(args)
    assert (args.batch_sizes, args.output_len) == ("1,8,32", 32)
    given = bench_options.engine_bench_defaults(build_parser().parse_args(["bench", "engine", "--output-len", "7"]))
    assert (given.batch_sizes, given.output_len) == ("1,8,32", 7)
    # bench speculative declares the same defaults as its own
    spec = build_parser().parse_args(["bench", "speculative"])
    assert (spec.batch_sizes, spec.output_len, spec.speculative) == ("1,8", 96, "ngram")


def test_engine_without_speculative_runs_the_engine_bench(monkeypatch, capsys):
    from bench import engine_bench

    calls = _record(monkeypatch, engine_bench, {"decode": {}})
    assert main(["bench", "engine", "--json"]) == 0
    assert _printed(capsys) == {"decode": {}} and len(calls) == 1


# ---- bench transfer --degrees ---------------------------------------------------------------------------------------


def test_transfer_degrees_runs_the_tp_handoff_experiment_instead(monkeypatch, capsys):
    from bench import transfer_bench
    from benchmarks import tp_handoff_bench

    calls = _record(monkeypatch, tp_handoff_bench, {"pairs": {"2:2": {}}})
    _refuse(monkeypatch, transfer_bench)
    argv = ["--degrees", "2:2", "--handoff-backend", "shm", "--requests", "1", "--prompt-len", "32", "--reps", "1"]
    argv.append("--json")
    assert main(["bench", "transfer", *argv]) == 0
    assert _printed(capsys) == {"pairs": {"2:2": {}}}
    (args,) = calls
    expected = _subcommand("bench", "tp-handoff", *argv)
    assert {k: v for k, v in vars(args).items() if k in expected} == expected
    assert (args.degrees, args.handoff_backend, args.requests, args.prompt_len, args.reps) == ("2:2", "shm", 1, 32, 1)


def test_transfer_degrees_defaults_are_the_old_ones(monkeypatch, capsys):
    from benchmarks import tp_handoff_bench

    calls = _record(monkeypatch, tp_handoff_bench, {})
    assert main(["bench", "transfer", "--degrees", "1:1"]) == 0
    (args,) = calls
    assert (args.handoff_backend, args.requests, args.prompt_len, args.reps) == ("zmq", 4, 256, 5)


def test_transfer_degrees_wins_over_overlap_as_it_did(monkeypatch, capsys):
    from bench import transfer_bench
    from benchmarks import overlap_bench, tp_handoff_bench

    calls = _record(monkeypatch, tp_handoff_bench, {"pairs": {}})
    _refuse(monkeypatch, transfer_bench)
    _refuse(monkeypatch, overlap_bench)
    assert main(["bench", "transfer", "--degrees", "1:1", "--overlap", "--json"]) == 0
    assert _printed(capsys) == {"pairs": {}} and len(calls) == 1


# ---- bench transfer --overlap ---------------------------------------------------------------------------------------


def test_transfer_overlap_nests_the_overlap_experiment_under_overlap(monkeypatch, capsys):
    from bench import transfer_bench
    from benchmarks import overlap_bench

    transfer_calls = _record(monkeypatch, transfer_bench, {"kv": {"dtype": "float16"}, "rows": []})
    overlap_calls = _record(monkeypatch, overlap_bench, {"hidden_fraction": 0.5})
    argv = ["--overlap", "--reps", "2", "--backends", "shm", "--overlap-prompt-tokens", "200", "--overlap-reps", "3"]
    argv += ["--overlap-max-tokens", "2", "--overlap-prefill-chunk", "64", "--overlap-config", "local"]
    argv += ["--int8-prompts", "2", "--int8-tokens", "8", "--json"]
    assert main(["bench", "transfer", *argv]) == 0
    assert _printed(capsys) == {"kv": {"dtype": "float16"}, "rows": [], "overlap": {"hidden_fraction": 0.5}}
    ((transfer_args,), (overlap_args,)) = transfer_calls, overlap_calls
    assert transfer_args.reps == 2 and transfer_args.backends == ["shm"]  # the transfer bench's own --reps
    # the overlap experiment gets what `bench overlap` parses for the same options, unprefixed; the int8 check runs
    # unless --overlap-no-int8, as it did
    same = ["--prompt-tokens", "200", "--reps", "3", "--max-tokens", "2", "--prefill-chunk", "64", "--config", "local"]
    same += ["--int8-check", "--int8-prompts", "2", "--int8-tokens", "8", "--json"]
    assert vars(overlap_args) == _subcommand("bench", "overlap", *same)


def test_transfer_overlap_defaults_and_no_int8(monkeypatch, capsys):
    from bench import transfer_bench
    from benchmarks import overlap_bench

    _record(monkeypatch, transfer_bench, {})
    calls = _record(monkeypatch, overlap_bench, {})
    assert main(["bench", "transfer", "--overlap"]) == 0
    assert main(["bench", "transfer", "--overlap", "--overlap-no-int8"]) == 0
    on, off = calls
    assert vars(on) == _subcommand("bench", "overlap", "--int8-check")
    assert vars(off) == _subcommand("bench", "overlap")
    assert (on.prompt_tokens, on.reps, on.max_tokens, on.config, on.int8_prompts) == (1024, 5, 4, "local", 20)


def test_transfer_without_flags_runs_the_transfer_bench_only(monkeypatch, capsys):
    from bench import transfer_bench
    from benchmarks import overlap_bench, tp_handoff_bench

    calls = _record(monkeypatch, transfer_bench, {"rows": []})
    _refuse(monkeypatch, overlap_bench)
    _refuse(monkeypatch, tp_handoff_bench)
    assert main(["bench", "transfer", "--json"]) == 0
    assert _printed(capsys) == {"rows": []} and len(calls) == 1


# ---- help, the table, and an installation without benchmarks/ -------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "flags"),
    [
        (
            "engine",
            ["--speculative", "--num-spec-tokens", "--ngram-max", "--batch1-prompts", "--compile-batches", "--prompt-sets"],
        ),
        (
            "transfer",
            [
                "--overlap", "--overlap-config", "--overlap-prompt-tokens", "--overlap-reps", "--overlap-max-tokens",
                "--overlap-prefill-chunk", "--overlap-no-int8", "--int8-prompts", "--int8-tokens",
                "--degrees", "--handoff-backend", "--requests", "--prompt-len",
            ],
        ),
    ],
)  # fmt: skip
def test_help_lists_the_flags(capsys, name, flags):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pdserve bench {name}")
    missing = [flag for flag in flags if f"  {flag} " not in out and f"  {flag}\n" not in out]
    assert not missing, missing
    if name == "engine":
        assert "default: 1,8,32 (with --speculative: 1,8)" in out and "default: 32 (with --speculative: 96)" in out


def test_every_route_names_a_benchmark_its_flag_an_experiment_and_an_adapter():
    benchmarks = {name: options for name, options, _, _, _ in BENCHMARKS}
    experiments = {name for name, *_ in EXPERIMENTS}
    assert {(r.benchmark, r.flag, r.experiment) for r in ROUTES} == {
        ("engine", "speculative", "speculative"),
        ("transfer", "degrees", "tp-handoff"),
        ("transfer", "overlap", "overlap"),
    }
    for route in ROUTES:
        assert (
            route.benchmark in benchmarks
            and route.experiment in experiments
            and route.experiment in (EXPERIMENT_MODULES)
        )
        assert hasattr(build_parser().parse_args(["bench", route.benchmark]), route.flag)
        if route.adapt is not None:
            assert callable(getattr(importlib.import_module(benchmarks[route.benchmark]), route.adapt))


@pytest.mark.parametrize(
    ("argv", "run_module"),
    [
        (["bench", "engine", "--speculative", "ngram"], "speculative_bench"),
        (["bench", "transfer", "--degrees", "1:1"], "tp_handoff_bench"),
        (["bench", "transfer", "--overlap"], "overlap_bench"),
    ],
)
def test_a_flag_reaching_an_experiment_outside_a_checkout_is_the_experiments_error(
    monkeypatch, capsys, tmp_path, argv, run_module
):
    """An installed wheel holds no benchmarks/: the flag fails at once (before the self-check runs) with the error
    `pdserve bench <experiment>` gives there."""
    from bench import engine_bench, transfer_bench

    _refuse(monkeypatch, engine_bench)
    _refuse(monkeypatch, transfer_bench)
    monkeypatch.setattr(cli_main, "CHECKOUT", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--json"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"source checkout (benchmarks/{run_module}.py)" in err and "does not hold" in err
    flag = argv[2]
    assert f"`pdserve bench {argv[1]} {flag}` or `python -m benchmarks.{run_module}`" in err
    # the experiment's own subcommand says the same
    experiment = {"speculative_bench": "speculative", "tp_handoff_bench": "tp-handoff", "overlap_bench": "overlap"}
    with pytest.raises(SystemExit):
        main(["bench", experiment[run_module], "--json"])
    assert f"source checkout (benchmarks/{run_module}.py)" in capsys.readouterr().err
