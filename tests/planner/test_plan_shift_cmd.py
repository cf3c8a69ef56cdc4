"""``pdserve plan shift`` as a user runs it: a profile file and a trace-jsonl file whose mix turns from prompts to
answers; it prints the fixed split's and the switching cluster's SLO attainment, the switch, and the ratio (both
simulated), and refuses a workload that is not a trace and a layout that is not P:D."""

from __future__ import annotations

import json

import pytest

from cli.main import main
from tests.planner.test_sim_switch import batch_profile, shifting_trace


@pytest.fixture
def files(tmp_path):
    profile = tmp_path / "profile.json"
    batch_profile().save(profile)
    trace = tmp_path / "shift.jsonl"
    rows = [
        {"arrival_s": r.arrival_s, "input_tokens": r.input_tokens, "output_tokens": r.output_tokens}
        for r in shifting_trace()
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return profile, trace


def test_plan_shift_prints_both_runs_and_the_switch(files, capsys):
    profile, trace = files
    argv = ["plan", "shift", "--profile", str(profile), "--workload", f"trace:trace-jsonl:{trace}", "--layout", "2:1"]
    assert main([*argv, "--slo", "ttft:2000", "tpot:200", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["label"].startswith("SIMULATED")
    fixed, switching = out["runs"]["fixed"], out["runs"]["switching"]
    assert fixed["requests"] == switching["requests"] == 180
    assert switching["met_slo"] > fixed["met_slo"] and switching["unserved"] == 0
    assert [(s["worker"], s["to"], s["phase"]) for s in out["switches"]] == [("prefill-1", "decode", "done")]
    assert out["switching_over_fixed"] > 1.2
    assert main([*argv, "--slo", "ttft:2000", "tpot:200"]) == 0
    text = capsys.readouterr().out
    assert "prefill-1 -> decode: done" in text and "switching / fixed:" in text


def test_plan_shift_refuses_what_it_cannot_run(files, capsys):
    profile, trace = files
    assert main(["plan", "shift", "--profile", str(profile), "--workload", "fixed:100:10"]) == 2
    assert "replays a trace" in capsys.readouterr().err
    layout = ["--layout", "x"]
    assert main(["plan", "shift", "--profile", str(profile), "--workload", f"trace:trace-jsonl:{trace}", *layout]) == 2
    assert "is not P:D" in capsys.readouterr().err
