"""The load tester needs only HTTP and a tokenizer: it imports nothing of pdserve's server (so it can test any
OpenAI-compatible one), and the pdserve defaults it carries as plain values (the built-in model's name and where
pdserve keeps it converted, the SLOs) still agree with pdserve's own. ``compare`` starts pdserve's cluster, so it
may import cluster/, and nothing below it."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.loadtest import options, workloads
from tests.helpers.imports import ROOT, imports_of, package_files

SERVER_PACKAGES = {"cli", "planner", "cluster", "prefill", "decode", "worker", "engine", "transfer", "torch", "ray"}
UNPACKAGED = {"benchmarks", "checks"}
# compare (bench/compare_modes.py) and the light options module it and plot take their options from
COMPARE_FILES = ("bench/compare_modes.py", "bench/options.py")
BELOW_CLUSTER = {"prefill", "decode", "worker", "engine", "transfer", "torch"}


def _forbidden(imports, packages: set[str]) -> list[str]:
    return [str(imp) for imp in imports if imp.module.split(".")[0] in packages]


def test_the_load_tester_imports_no_server_code():
    files = [p for p in package_files("bench") if p.relative_to(ROOT).parts[:2] == ("bench", "loadtest")]
    assert len(files) >= 8 and ROOT / "bench" / "loadtest" / "plots.py" in files  # plot is in there
    found = _forbidden([imp for path in files for imp in imports_of(path)], SERVER_PACKAGES | UNPACKAGED)
    assert not found, "the load tester imports server code:\n" + "\n".join(found)


def test_compare_imports_the_cluster_but_nothing_of_the_engine():
    files = [ROOT / name for name in COMPARE_FILES]
    assert all(imports_of(path) for path in files)
    found = _forbidden([imp for path in files for imp in imports_of(path)], BELOW_CLUSTER | UNPACKAGED)
    assert not found, "compare imports the engine or what lies below the cluster:\n" + "\n".join(found)


def test_a_forbidden_import_is_found_wherever_it_is():
    """The checks above on source written here: an import inside a function counts as much as one at the top."""
    source = "import httpx\n\n\ndef tokenizer():\n    from engine.model_loader import resolve_model_path\n"
    found = _forbidden(imports_of(ROOT / "bench" / "loadtest" / "probe.py", source), SERVER_PACKAGES)
    assert found and all(f.startswith("bench/loadtest/probe.py:5: from engine.model_loader") for f in found), found
    cluster_only = imports_of(ROOT / "bench" / "probe.py", "from cluster.config import load_config\n")
    assert _forbidden(cluster_only, BELOW_CLUSTER) == []


def test_importing_and_parsing_the_load_tester_loads_no_torch_or_server_code():
    code = (
        "import argparse, json, sys\n"
        "from bench.loadtest import cli, client, metrics, output, shapes, sse, workloads\n"
        "parser = argparse.ArgumentParser()\n"
        "cli.add_arguments(parser)\n"
        "args = parser.parse_args(['--base-url', 'http://127.0.0.1:9', '--rates', '1,2', '--goodput', 'ttft:500'])\n"
        "print(json.dumps({'rates': args.rates, 'modules': sorted(sys.modules)}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    assert out["rates"] == "1,2"
    loaded = {m.split(".")[0] for m in out["modules"]}
    assert "bench" in loaded and not loaded & (SERVER_PACKAGES | {"transformers"}), sorted(
        loaded & (SERVER_PACKAGES | {"transformers"})
    )


def test_pdserve_defaults_written_in_the_load_tester_agree_with_pdserve(tmp_path, monkeypatch):
    from cluster.config import SLOSection
    from engine.model_loader import DEFAULT_MODEL, resolve_model_path

    assert options.PDSERVE_DEFAULT_MODEL == DEFAULT_MODEL
    # where the load tester looks for the built-in model's tokenizer is where the engine keeps it converted
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    folder = workloads.pdserve_model_folder(DEFAULT_MODEL)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert resolve_model_path(DEFAULT_MODEL) == folder  # found there, nothing converted
    slo = SLOSection()
    assert options.PDSERVE_DEFAULT_SLOS_MS == {"ttft": slo.ttft_s * 1000.0, "tpot": slo.tpot_s * 1000.0}
