"""``pdserve --help``, ``pdserve status`` and argument parsing start without torch, transformers, Ray or any
package below the CLI: the modules a subcommand needs are imported only when that subcommand runs.

Each check runs a fresh interpreter (``python -c``, and ``python -X importtime -m cli.main --help`` as the issue asks)
and reads which modules it imported, so nothing this test process already imported can hide a heavy import. Wall
time is not asserted (this machine is shared); the imports are what make the start slow, and they are asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cli.main import BENCHMARKS, EXPERIMENTS
from tests.helpers.imports import ROOT

HEAVY = {"torch", "transformers", "ray"}
BELOW_CLI = {"bench", "planner", "cluster", "prefill", "decode", "worker", "engine", "transfer"}
OUTSIDE = {"benchmarks", "checks"}  # the source checkout's experiments and acceptance checks: not the product
# every `pdserve bench` subcommand: (name, options module, run module), the experiments' with their package's name
BENCH_COMMANDS = [(name, options, run) for name, options, _, run, _ in BENCHMARKS] + [
    (name, f"benchmarks.{options}", f"benchmarks.{run}") for name, options, _, run, _ in EXPERIMENTS
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PDSERVE_API_KEY", None)
    return env


RUN_AS_PDSERVE = """
import json, os, runpy, sys
sys.argv = ["pdserve", *json.loads(os.environ["PDSERVE_TEST_ARGV"])]
status = 0
try:
    runpy.run_module("cli.main", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    status = exc.code if isinstance(exc.code, int) else 1
with open(os.environ["PDSERVE_TEST_MODULES"], "w") as out:
    json.dump(sorted(sys.modules), out)
sys.exit(status)
"""


def run_cli(tmp_path, *argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``pdserve ARGV`` in a fresh interpreter (as ``python -m cli.main`` would); the finished process and
    every module in its ``sys.modules`` at exit (importlib's imports included, which ``-X importtime`` misses)."""
    modules_file = tmp_path / "modules.json"
    env = _env() | {"PDSERVE_TEST_ARGV": json.dumps(argv), "PDSERVE_TEST_MODULES": str(modules_file)}
    proc = subprocess.run(
        [sys.executable, "-c", RUN_AS_PDSERVE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    return proc, set(json.loads(modules_file.read_text()))


def top_level(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["status", "--help"],
        ["serve", "--help"],
        ["demo", "--help"],
        ["bench", "--help"],
        ["model", "tiny", "--help"],
    ],
)
def test_help_imports_nothing_below_the_cli(tmp_path, argv):
    proc, modules = run_cli(tmp_path, *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: pdserve")
    assert not top_level(modules) & (HEAVY | BELOW_CLI | OUTSIDE), sorted(
        m for m in modules if m.split(".")[0] in HEAVY | BELOW_CLI | OUTSIDE
    )


def test_parsing_every_non_bench_command_imports_nothing_below_the_cli():
    """The parser alone (``python -c``), for each subcommand's arguments, without running the subcommand."""
    code = (
        "import json, sys\n"
        "from cli.main import build_parser\n"
        "parser = build_parser()\n"
        "for argv in (['serve', '--config', 'x.yaml', '--port', '0'], ['status', '--url', 'http://h:1', '--json'],\n"
        "             ['demo', '--max-tokens', '4'], ['model', 'tiny', 'out', '--arch', 'qwen2'], ['-v', 'status']):\n"
        "    assert callable(parser.parse_args(argv).func)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = top_level(set(json.loads(proc.stdout)))
    assert "cli.main" in json.loads(proc.stdout)  # the check really ran the parser
    assert not loaded & (HEAVY | BELOW_CLI), sorted(loaded & (HEAVY | BELOW_CLI))


@pytest.mark.parametrize(("name", "options_module", "run_module"), BENCH_COMMANDS)
def test_a_benchmarks_options_are_declared_without_torch_or_the_cluster(tmp_path, name, options_module, run_module):
    """``pdserve bench NAME --help`` imports the light module declaring the options, not the benchmark itself; a
    product benchmark's, nothing of the experiments (benchmarks/) or the acceptance checks (checks/)."""
    proc, modules = run_cli(tmp_path, "bench", name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: pdserve bench {name}") and "--json" in proc.stdout
    assert options_module in modules
    if run_module != options_module:
        assert run_module not in modules
    outside = OUTSIDE - {"benchmarks"} if options_module.startswith("benchmarks.") else OUTSIDE
    assert not top_level(modules) & (HEAVY | BELOW_CLI - {"bench"} | outside), sorted(
        m for m in modules if m.split(".")[0] in HEAVY | BELOW_CLI - {"bench"} | outside
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "engine", "--speculative", "ngram", "--batch1-prompts", "2"],
        ["bench", "transfer", "--degrees", "1:1", "--requests", "1"],
        ["bench", "transfer", "--overlap", "--overlap-reps", "1"],
    ],
)
def test_parsing_a_self_checks_flag_that_reaches_an_experiment_imports_nothing_heavy(argv):
    """``bench engine --speculative``, ``bench transfer --degrees`` and ``--overlap`` (cli/main.py's ``ROUTES``): the
    parse checks the checkout holds the experiment by loading its light options module, not the experiment."""
    code = (
        "import json, sys\n"
        "from cli.main import build_parser\n"
        f"args = build_parser().parse_args({argv!r})\n"
        "assert callable(args.func)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = set(json.loads(proc.stdout))
    assert "bench.options" in modules
    assert not {"benchmarks.speculative_bench", "benchmarks.tp_handoff_bench", "bench.engine_bench"} & modules
    assert not top_level(modules) & (HEAVY | BELOW_CLI - {"bench"} | OUTSIDE - {"benchmarks"}), sorted(
        m for m in modules if m.split(".")[0] in HEAVY | BELOW_CLI - {"bench"} | OUTSIDE - {"benchmarks"}
    )


def test_every_experiment_is_a_bench_subcommand_and_runs_as_a_module():
    """Each experiment's run module is in benchmarks/ and runs as ``python -m benchmarks.<module>`` too."""
    assert {name for name, _, _ in BENCH_COMMANDS} >= {"chaos", "migrate", "speculative", "overlap", "tp-handoff"}
    assert not {name for name, *_ in BENCHMARKS} & {name for name, *_ in EXPERIMENTS}
    for _, _, _, run_module, _ in EXPERIMENTS:
        source = (ROOT / "benchmarks" / f"{run_module}.py").read_text()
        assert 'if __name__ == "__main__":' in source, run_module


def test_an_experiment_outside_a_source_checkout_is_a_clear_error(tmp_path):
    """An installed wheel holds no benchmarks/: ``pdserve bench chaos`` says to run it from a checkout."""
    code = (
        "import pathlib, sys\n"
        "import cli.main as m\n"
        f"m.CHECKOUT = pathlib.Path({str(tmp_path)!r})\n"
        "sys.exit(m.main(['bench', 'chaos', '--json']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "source checkout (benchmarks/chaos.py)" in proc.stderr
    assert "`pdserve bench chaos` or `python -m benchmarks.chaos`" in proc.stderr


def test_only_the_chosen_benchmarks_options_are_declared():
    """Parsing one benchmark's arguments loads that benchmark's options module and no other benchmark's."""
    code = (
        "import json, sys\n"
        "from cli.main import build_parser\n"
        "args = build_parser().parse_args(['bench', 'detok', '--tiny', '--lengths', '10', '--json'])\n"
        "print(json.dumps({'lengths': args.lengths, 'json': args.json, 'modules': sorted(sys.modules)}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["lengths"] == "10" and out["json"] is True
    bench_modules = {m for m in out["modules"] if m.split(".")[0] in ("bench", "benchmarks")}
    assert bench_modules == {"benchmarks", "benchmarks.detok_bench"}
    assert not top_level(set(out["modules"])) & HEAVY


def test_status_against_a_router_imports_nothing_below_the_cli(tmp_path, status_server):
    server = status_server()
    proc, modules = run_cli(tmp_path, "status", "--url", server.url)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prefill-0" in proc.stdout and "decode-0" in proc.stdout and "disaggregated" in proc.stdout
    assert server.authorizations == [None]  # it really asked the router
    assert not top_level(modules) & (HEAVY | BELOW_CLI), sorted(
        m for m in modules if m.split(".")[0] in HEAVY | BELOW_CLI
    )


def test_importtime_of_help_shows_no_heavy_import():
    """The check of the issue, as written there: ``python -X importtime -m cli.main --help``."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "cli.main", "--help"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.startswith("usage: pdserve")
    timed = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "cli.status" in timed  # the output was read
    assert not top_level(timed) & (HEAVY | BELOW_CLI), sorted(m for m in timed if m.split(".")[0] in HEAVY | BELOW_CLI)
