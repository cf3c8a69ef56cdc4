"""The load tester needs only HTTP and a tokenizer: it imports nothing of pdserve's server (so it can test any
OpenAI-compatible one), and the two pdserve defaults it carries as plain values still agree with pdserve's own."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.loadtest import options
from tests.helpers.imports import ROOT, imports_of, package_files

SERVER_PACKAGES = {"cli", "planner", "cluster", "prefill", "decode", "worker", "engine", "transfer", "torch", "ray"}
# the one allowed exception: the default tokenizer, when neither --tokenizer nor a model folder is given, is pdserve's
# default model's, and only pdserve's engine knows where its converted folder is
ALLOWED = {("bench/loadtest/workloads.py", "engine.model_loader")}


def _allowed(path: str, module: str) -> bool:
    return any(path == where and (module == name or module.startswith(f"{name}.")) for where, name in ALLOWED)


def test_the_load_tester_imports_no_server_code():
    files = [p for p in package_files("bench") if p.relative_to(ROOT).parts[:2] == ("bench", "loadtest")]
    assert len(files) >= 8
    found = [
        str(imp)
        for path in files
        for imp in imports_of(path)
        if imp.module.split(".")[0] in SERVER_PACKAGES and not _allowed(str(path.relative_to(ROOT)), imp.module)
    ]
    assert not found, "the load tester imports server code:\n" + "\n".join(found)


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


def test_pdserve_defaults_written_in_the_load_tester_agree_with_pdserve():
    from cluster.config import SLOSection
    from engine.model_loader import DEFAULT_MODEL

    assert options.PDSERVE_DEFAULT_MODEL == DEFAULT_MODEL
    slo = SLOSection()
    assert options.PDSERVE_DEFAULT_SLOS_MS == {"ttft": slo.ttft_s * 1000.0, "tpot": slo.tpot_s * 1000.0}
