"""``bench compare`` (bench/compare_modes.py) against a fake ``cluster.run.launch.start_serving`` that serves the scripted server."""

import argparse
import sys
import types

import pytest
import yaml

from bench import compare_modes as compare
from bench.loadtest import plots
from tests.bench.loadtest.scripted_server import Script, ScriptedServer


def test_compare_runs_both_modes_and_writes_table_and_plots(tmp_path, byte_tokenizer_dir, monkeypatch):
    started = []

    class Handle:
        def __init__(self, config):
            # disaggregated: slower first token, steadier decode (what the scripted server pretends)
            slow = config.mode == "disaggregated"
            self.server = ScriptedServer(
                lambda body, n: Script(
                    ttft_s=0.06 if slow else 0.03,
                    gap_s=0.01 if slow else 0.02,
                    tokens=4,
                    timing={
                        "router_queue_s": 0.001,
                        "prefill_compute_s": 0.02,
                        "ttft_s": 0.025,
                        **({"kv_transfer_s": 0.005} if slow else {}),
                    },
                )
            ).__enter__()
            self.base_url = self.server.base_url
            self.num_workers = 2
            self.config = config
            self.stopped = False
            started.append(self)

        def worker_infos(self):
            if self.config.mode == "disaggregated":
                return [{"name": "prefill-0", "role": "prefill"}, {"name": "decode-0", "role": "decode"}]
            return [{"name": f"worker-{i}", "role": "colocated"} for i in range(2)]

        def stop(self):
            self.server.stop()
            self.stopped = True

    fake = types.ModuleType("cluster.run.launch")
    fake.start_serving = Handle
    monkeypatch.setitem(sys.modules, "cluster.run.launch", fake)

    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(
        yaml.safe_dump({"mode": "disaggregated", "router": {"port": 8000}, "slo": {"ttft_s": 0.05, "tpot_s": 0.1}})
    )
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(
        [
            "--config",
            str(config_path),
            "--tokenizer",
            str(byte_tokenizer_dir),
            "--rates",
            "20,40",
            "--num-prompts",
            "4",
            "--random-input-len",
            "24",
            "--random-output-len",
            "4",
            "--disable-tqdm",
            "--result-dir",
            str(tmp_path / "cmp"),
        ]
    )
    summary = compare.run(args)

    assert [h.config.mode for h in started] == ["colocated", "disaggregated"]
    assert all(h.config.router.port == 0 and h.stopped for h in started)
    assert [(r["mode"], r["rate"]) for r in summary["runs"]] == [
        ("colocated", 20.0),
        ("colocated", 40.0),
        ("disaggregated", 20.0),
        ("disaggregated", 40.0),
    ]
    assert summary["benchmark"]["slo_ms"] == {"ttft": 50.0, "tpot": 100.0}  # from the config's slo section
    colocated, disaggregated = summary["modes"]["colocated"], summary["modes"]["disaggregated"]
    assert colocated["sweep"]["max_rate_meeting_slo"] == 40.0 and colocated["sweep"]["max_rate_per_worker"] == 20.0
    assert disaggregated["sweep"]["max_rate_meeting_slo"] is None  # TTFT 60 ms > 50 ms
    out = tmp_path / "cmp"
    table = (out / "table.txt").read_text()
    assert "colocated" in table and "disaggregated" in table
    for name in (
        "summary.json",
        "summary.csv",
        "requests.jsonl",
        "ttft_cdf.png",
        "tpot_itl_cdf.png",
        "latency_vs_rate.png",
        "ttft_breakdown.png",
    ):
        assert (out / name).stat().st_size > 0, name
    assert len((out / "summary.csv").read_text().splitlines()) == 5
    assert '"mode": "disaggregated"' in (out / "requests.jsonl").read_text()

    assert disaggregated["roles"] == {"prefill": 1, "decode": 1} and colocated["roles"] == {"colocated": 2}
    head, tail = plots.caption(summary).splitlines()
    assert str(config_path) in head and "random 24 in / 4 out, 4 prompts per rate" in head
    assert tail.startswith("rates 20.0, 40.0 req/s (poisson)")
    assert "colocated 2 workers; disaggregated 1 prefill + 1 decode" in tail and summary["date"] in tail

    # the same plots again from the folder alone
    before = {name: (out / name).stat().st_mtime_ns for name in summary["plots"]}
    redrawn = plots.run(argparse.Namespace(result_dir=str(out)))
    assert redrawn["plots"] == summary["plots"]
    assert all((out / name).stat().st_mtime_ns >= before[name] for name in summary["plots"])
    loaded, results = plots.load_folder(out)
    assert [len([r for r in rs if not r.warmup]) for rs in results] == [4, 4, 4, 4]
    assert all(r.success and r.server_timing for rs in results for r in rs if not r.warmup)


def test_plot_command_names_a_folder_that_is_not_a_results_folder(tmp_path):
    with pytest.raises(ValueError, match="not a results folder"):
        plots.run(argparse.Namespace(result_dir=str(tmp_path)))
