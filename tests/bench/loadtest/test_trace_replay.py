"""Trace replay (bench/loadtest/replay.py, shapes.py's fixed schedule): each row sent at its own time on a fake clock
(never early, a late wake-up shows as lag), the options a trace takes and refuses, what a replay's summary adds
(rows, schedule lag, prefix hit rates, per-minute series with KV samples) and the speed-up sweep of ``compare``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import types
from pathlib import Path

import pytest
import yaml

from bench import compare_modes as compare
from bench.loadtest import cli, replay
from bench.loadtest.client import RequestResult, RequestSettings, RequestSpec
from bench.loadtest.shapes import Clock, LoadShape, run_phase
from bench.loadtest.traces import TraceFit, fit_trace, read_trace
from tests.bench.loadtest.scripted_server import Script, ScriptedServer

MOONCAKE = Path(__file__).parent / "traces" / "mooncake_excerpt.jsonl"


class FakeClock(Clock):
    """Time moves only when the sender sleeps: by what it asked, plus ``late_s``, times ``short`` (below 1: it
    wakes early). What is ready runs before time moves."""

    def __init__(self, late_s: float = 0.0, short: float = 1.0) -> None:
        self.t = 1000.0
        self.late_s, self.short = late_s, short
        self.sleeps: list[float] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
        self.sleeps.append(seconds)
        self.t += seconds * self.short + self.late_s


def replay_on(clock: FakeClock, schedule: list[float], **shape) -> list[RequestResult]:
    sent_at: list[tuple[int, float]] = []

    async def send(client, spec: RequestSpec, settings, result: RequestResult) -> RequestResult:
        sent_at.append((spec.index, clock.now()))
        result.success = True
        return result

    specs = [RequestSpec(i, f"p{i}", 1, 1) for i in range(len(schedule))]
    results, duration, _ = asyncio.run(
        run_phase(
            specs,
            LoadShape(num_prompts=len(schedule), schedule=schedule, **shape),
            RequestSettings(base_url="http://127.0.0.1:9", model="m"),
            progress=False,
            clock=clock,
            send=send,
        )
    )
    assert [i for i, _ in sent_at] == list(range(len(schedule)))  # in the schedule's order, each once
    return results


def test_each_row_is_sent_at_its_own_time_not_at_a_rate():
    schedule = [0.0, 0.0, 0.5, 2.0, 2.0, 2.0, 7.25]
    clock = FakeClock()
    results = replay_on(clock, schedule)
    assert [r.scheduled_s for r in results] == schedule
    assert [r.sent_s for r in results] == schedule  # on time, to the clock's last digit
    assert clock.sleeps == [0.5, 1.5, 5.25]  # slept exactly to each distinct time, never for a rate's gap
    assert replay.schedule_lag_ms(results)["p99"] == 0.0


def test_a_late_wake_up_is_lag_and_an_early_one_is_slept_off():
    late = replay_on(FakeClock(late_s=0.03), [0.0, 1.0, 1.0, 3.0])
    assert [round(r.sent_s - r.scheduled_s, 6) for r in late] == [0.0, 0.03, 0.03, 0.03]
    lag = replay.schedule_lag_ms(late)
    assert lag["p50"] == pytest.approx(30.0) and lag["max"] == pytest.approx(30.0)
    early = replay_on(FakeClock(short=0.5), [0.0, 1.0, 3.0])
    assert all(r.sent_s >= r.scheduled_s for r in early)  # never before its time
    assert all(r.sent_s - r.scheduled_s < 1e-6 for r in early)


def test_the_schedule_is_the_fitted_traces_at_each_speedup(byte_tokenizer_dir):
    args = parse(
        ["--dataset-name", "mooncake", "--dataset-path", str(MOONCAKE), "--trace-speedups", "0.5,2"],
        ["--trace-token-scale", "0.03125", "--max-rows", "12", "--tokenizer", str(byte_tokenizer_dir)],
    )
    plan = cli.prepare(args, None)
    raw = read_trace("mooncake", MOONCAKE)
    for shape, speedup in zip(plan.shapes, (0.5, 2.0)):
        assert shape.schedule == [r.arrival_s / speedup for r in raw.rows[:12]]
        assert shape.rate_label == round(12 / (3.0 / speedup), 4)  # rows over the span, at that speed-up
    assert [len(plan.specs_for(i)) for i in (0, 1)] == [12, 12]
    assert plan.specs_for(0)[1].prompt != plan.specs_for(1)[1].prompt  # a later speed-up, other tokens
    assert plan.slos and plan.slo_source.startswith("cluster.config")  # a trace always measures attainment


def parse(*parts: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args([a for part in parts for a in part] + ["--disable-tqdm"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rates", "1,2"], "--rates: a trace is replayed on its own schedule"),
        (["--request-rate", "3"], "--request-rate: a trace is replayed on its own schedule"),
        (["--ramp-up-s", "5"], "--ramp-up-s: a trace"),
        (["--trace-speedup", "2", "--trace-speedups", "1,2"], "not both"),
        (["--trace-speedup", "0"], "--trace-speedup must be a positive number"),
        (["--trace-speedups", "1,x"], "--trace-speedups: '1,x' is not a comma-separated list"),
        (["--trace-token-scale", "-1"], "--trace-token-scale must be a positive number"),
        (["--trace-window", "600-1200"], "--trace-window must be START:END"),
        (["--trace-window", "9:3"], "--trace-window must be START:END with 0 <= START < END"),
        (["--trace-window", "500:600"], "no row to send: --trace-window 500:600 holds 0 rows"),
        (["--max-rows", "0"], "--max-rows must be at least 1"),
        (["--max-context-tokens", "1"], "--max-context-tokens must be at least 2"),
        (
            ["--max-context-tokens", "10"],
            "no row to send: the trace holds 60 rows .* 60 of them over the context of 10",
        ),
    ],
)
def test_a_trace_refuses_a_rate_and_bad_fits(argv, message, byte_tokenizer_dir):
    args = parse(["--dataset-name", "mooncake", "--dataset-path", str(MOONCAKE)], argv)
    with pytest.raises(ValueError, match=message):
        cli.prepare(args, str(byte_tokenizer_dir))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--trace-speedup", "2"], r"--trace-speedup applies to a trace replay \(--dataset-name mooncake"),
        (["--max-rows", "5"], "--max-rows applies to a trace replay"),
        (["--dataset-name", "azure"], "--dataset-name azure needs --dataset-path"),
        (["--dataset-name", "burstgpt", "--dataset-path", "/nonexistent"], "'/nonexistent' is not a file"),
    ],
)
def test_trace_options_need_a_trace(argv, message, byte_tokenizer_dir):
    with pytest.raises(ValueError, match=message):
        cli.prepare(parse(argv), str(byte_tokenizer_dir))


def test_a_bound_that_leaves_rows_unsent_leaves_them_out_of_the_ideal_hit_rate(tmp_path):
    path = tmp_path / "own.jsonl"
    rows = [(0.0, [1, 2]), (1.0, [1, 2]), (2.0, [1, 2]), (9.0, [3, 4])]
    path.write_text(
        "\n".join(
            json.dumps({"arrival_s": t, "input_tokens": 8, "output_tokens": 1, "hash_ids": ids, "block_tokens": 4})
            for t, ids in rows
        )
    )
    trace = fit_trace(read_trace("trace-jsonl", path), TraceFit())
    results = [RequestResult(i, scheduled_s=t, sent_s=t if t < 5 else None) for i, (t, _) in enumerate(rows)]
    run = {"completed": 3, "failed": 1, "duration_s": 5.0, "cached_tokens": None}
    summary = replay.summarize(results, trace, run, [])
    assert summary["rows"] == {
        "in_window": 4,
        "over_context": 0,
        "scheduled": 4,
        "sent": 3,
        "completed": 3,
        "failed": 1,
    }
    assert summary["prefix_hit_rate"] == {"ideal": 16 / 24, "measured": None, "measured_over_ideal": None}
    assert trace.ideal_prefix_hit_rate() == 16 / 32  # with the unsent row


def test_the_per_minute_series_and_the_kv_samples():
    results = [
        RequestResult(0, scheduled_s=1.0, sent_s=1.0, success=True, ttft_s=0.1),
        RequestResult(1, scheduled_s=50.0, sent_s=50.2, success=True, ttft_s=0.3),
        RequestResult(2, scheduled_s=70.0, sent_s=70.0, success=False),
        RequestResult(3, scheduled_s=130.0, sent_s=None),  # due, never sent (cut by the bound)
    ]
    samples = [(0.0, {"prefill": 0.5, "decode": 0.1}), (30.0, {"prefill": 0.25}), (61.0, {"decode": 0.3})]
    series = replay.minute_series(results, samples, duration_s=150.0)
    assert series["start_s"] == [0.0, 60.0, 120.0] and series["arrivals"] == [2, 1, 1]
    assert series["ttft_p90_ms"][0] == pytest.approx(280.0) and series["ttft_p90_ms"][1:] == [None, None]
    assert series["kv_used"]["prefill"] == {"mean": [0.375, None, None], "max": [0.5, None, None]}
    assert series["kv_used"]["decode"]["mean"] == [0.1, 0.3, None]
    status = {
        "workers": [
            {"role": "prefill", "alive": True, "free_blocks": 30, "total_blocks": 40},
            {"role": "prefill", "alive": True, "free_blocks": 40, "total_blocks": 40},
            {"role": "decode", "alive": False, "free_blocks": 0, "total_blocks": 40},
            {"role": "decode", "alive": True},  # no heartbeat yet
        ]
    }
    assert replay.kv_used(status) == {"prefill": 0.125}
    assert replay.kv_used({"object": "list"}) == {} and replay.kv_used([1]) == {}


def test_a_replay_against_a_scripted_server_reports_what_it_is_for(tmp_path, byte_tokenizer_dir):
    """Rows in the window, over the context and sent; the lag; the trace's ideal hit rate beside the server's
    cached tokens; the series (no KV: not pdserve); the table line, the CSV columns and the series plot."""
    with ScriptedServer(lambda body, n: Script(ttft_s=0.01, gap_s=0.0, tokens=2, cached_tokens=4)) as server:
        args = parse(
            ["--base-url", server.base_url, "--tokenizer", str(byte_tokenizer_dir), "--result-dir", str(tmp_path)],
            ["--dataset-name", "mooncake", "--dataset-path", str(MOONCAKE), "--trace-window", "5:10"],
            ["--trace-token-scale", "0.03125", "--trace-speedup", "10", "--max-context-tokens", "500"],
            ["--num-warmups", "1"],
        )
        summary = cli.run(args)
    assert server.gets == ["/status"]  # asked once: not pdserve, no KV samples (the context was given)
    [run] = summary["runs"]
    fitted = fit_trace(read_trace("mooncake", MOONCAKE), TraceFit(10.0, 1 / 32, (5.0, 10.0), None, 500))
    assert run["rows"] == {
        "in_window": 12,
        "over_context": 12 - len(fitted.rows),
        "scheduled": len(fitted.rows),
        "sent": len(fitted.rows),
        "completed": len(fitted.rows),
        "failed": 0,
    }
    assert run["rows"]["over_context"] == 2  # 26156 / 32 and 16635 / 32 prompt tokens, plus their outputs
    assert run["trace_speedup"] == 10.0 and run["rate"] == round(10 / 0.3001, 4)
    assert run["schedule_lag_ms"]["count"] == 10 and run["schedule_lag_ms"]["p99"] >= 0.0
    hit = run["prefix_hit_rate"]
    assert hit["ideal"] == pytest.approx(summary["benchmark"]["trace"]["ideal_prefix_hit_rate"]) and hit["ideal"] > 0
    assert hit["measured"] == pytest.approx(4 * 10 / run["total_input_tokens"])
    assert sum(run["series"]["arrivals"]) == 10 and run["series"]["kv_used"] == {}
    assert run["warmups"] == {"requests": 1, "failed": 0} and run["slo_attainment_pct"] is not None
    trace = summary["benchmark"]["trace"]
    assert trace["context_tokens"] == 500 and trace["context_source"] == "--max-context-tokens"
    assert trace["block_tokens"] == 16 and trace["rows"]["scheduled"] == 10
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [r["trace_line"] for r in records if not r["warmup"]] == [r.line for r in fitted.rows]
    assert "trace_series.png" in summary["plots"] and (tmp_path / "trace_series.png").stat().st_size > 0
    assert "schedule_lag_p99_ms" in (tmp_path / "summary.csv").read_text().splitlines()[0]


def test_the_context_comes_from_the_servers_models_list(tmp_path, byte_tokenizer_dir, monkeypatch):
    asked = []

    def context(base_url, model, api_key=None):
        asked.append((base_url, model))
        return 400

    monkeypatch.setattr(replay, "server_context", context)
    with ScriptedServer(lambda body, n: Script(ttft_s=0.0, gap_s=0.0, tokens=1)) as server:
        args = parse(
            ["--base-url", server.base_url, "--tokenizer", str(byte_tokenizer_dir), "--result-dir", str(tmp_path)],
            ["--dataset-name", "mooncake", "--dataset-path", str(MOONCAKE), "--max-rows", "12"],
            ["--trace-token-scale", "0.03125", "--trace-speedup", "100"],
        )
        summary = cli.run(args)
    assert asked == [(server.base_url, args.model)]
    trace = summary["benchmark"]["trace"]
    assert trace["context_tokens"] == 400 and trace["context_source"].startswith("the server")
    # rows 7, 8, 10, 11 and 12: 723, 840, 545, 423 and 2724 prompt tokens
    assert summary["runs"][0]["rows"]["over_context"] == 5 and summary["runs"][0]["rows"]["sent"] == 7


def test_compare_sweeps_speedups_and_draws_the_attainment_curves(tmp_path, byte_tokenizer_dir, monkeypatch):
    class Handle:
        def __init__(self, config):
            slow = config.mode == "disaggregated"
            self.server = ScriptedServer(lambda body, n: Script(ttft_s=0.03 if slow else 0.01, gap_s=0.0, tokens=2))
            self.server.__enter__()
            self.base_url, self.num_workers, self.config = self.server.base_url, 2, config

        def worker_infos(self):
            return [{"name": "a", "role": "prefill"}, {"name": "b", "role": "decode"}]

        def stop(self):
            self.server.stop()

    fake = types.ModuleType("cluster.run.launch")
    fake.start_serving = Handle  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cluster.run.launch", fake)
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(
        yaml.safe_dump({"model": {"max_model_len": 500}, "router": {"port": 8000}, "slo": {"ttft_s": 0.02}})
    )
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(
        ["--config", str(config_path), "--tokenizer", str(byte_tokenizer_dir), "--disable-tqdm"]
        + ["--dataset-name", "mooncake", "--dataset-path", str(MOONCAKE), "--max-rows", "12"]
        + ["--trace-token-scale", "0.03125", "--trace-speedups", "50,100", "--result-dir", str(tmp_path / "cmp")]
    )
    summary = compare.run(args)
    assert [(r["mode"], r["trace_speedup"]) for r in summary["runs"]] == [
        ("colocated", 50.0),
        ("colocated", 100.0),
        ("disaggregated", 50.0),
        ("disaggregated", 100.0),
    ]
    sent = fit_trace(
        read_trace("mooncake", MOONCAKE), TraceFit(max_rows=12, token_scale=1 / 32, max_context_tokens=500)
    )
    span = sent.rows[-1].arrival_s  # the rows sent span this much trace time: the rate is rows per its share
    assert [r["rate"] for r in summary["runs"][:2]] == [round(len(sent.rows) / (span / s), 4) for s in (50, 100)]
    assert summary["benchmark"]["trace"]["context_source"].endswith("model.max_model_len")
    assert all(r["rows"]["over_context"] == 12 - len(sent.rows) == 4 for r in summary["runs"])
    assert "slo_attainment_curves.png" in summary["plots"]
    assert (tmp_path / "cmp" / "slo_attainment_curves.png").stat().st_size > 0
    assert all(summary["modes"][mode]["sweep"]["target_attainment_pct"] == 90.0 for mode in summary["modes"])


def test_the_shipped_trace_config_matches_the_recommended_token_scale():
    """configs/local-trace.yaml (docs/loadtest.md): kv_aware routing, KV blocks the size of Mooncake's hash blocks at
    --trace-token-scale 1/64, a context that holds the trace's longest row at that scale."""
    from cluster.config import load_config

    config = load_config(Path(__file__).parents[3] / "configs" / "local-trace.yaml")
    assert config.router.prefill_policy == config.router.decode_policy == "kv_aware"
    assert config.transfer.block_size == round(512 / 64)
    assert config.model.max_model_len is not None and config.model.max_model_len >= 1972 + 5


def _sampled(bodies: list[object]) -> list[tuple[float, dict[str, float]]]:
    """What a KvSampler keeps of ``/status`` answering ``bodies`` in turn (then the last one again), for 0.3 s."""
    import httpx

    answers = iter(bodies)
    last: list[object] = [None]

    def handler(request: httpx.Request) -> httpx.Response:
        last[0] = next(answers, last[0])
        body = last[0]
        return httpx.Response(200, json=body) if body is not None else httpx.Response(404)

    async def go() -> list[tuple[float, dict[str, float]]]:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        sampler = replay.KvSampler("http://server", period_s=0.01, client=client)
        task = asyncio.ensure_future(sampler.run(0.0))
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return sampler.samples

    return asyncio.run(go())


def test_the_kv_sampler_waits_for_pdserves_first_heartbeats_and_stops_at_once_for_another_server():
    before = {"workers": [{"name": "prefill-0", "role": "prefill", "alive": True}]}  # no heartbeat yet: no blocks
    after = {"workers": [{"role": "prefill", "alive": True, "total_blocks": 10, "free_blocks": 4}]}
    samples = _sampled([before, before, after])
    assert samples and all(used == {"prefill": pytest.approx(0.6)} for _, used in samples)
    assert _sampled([None, after]) == []  # not pdserve's /status: one request, then no more
