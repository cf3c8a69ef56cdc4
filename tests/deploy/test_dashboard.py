"""The Grafana dashboard (deploy/grafana/pdserve.json) and the scrape config (deploy/prometheus/prometheus.yml) against
a live tiny cluster (in process: one prefill and two decode workers, a queue of 0 so that a burst gets 429s).

Always: the dashboard is well formed, every panel has queries, and every metric, ``key`` and label its queries name
is one the router's /metrics serves. With Debian's ``prometheus`` binary on the PATH (CI has none: skipped): a real
Prometheus on 127.0.0.1 scrapes the cluster every second while a short load runs (plain and repeated prompts, a
stream moved to the other decode worker, a burst that gets 429s), then every query of every panel, its variables
filled in, must return data with a finite value. ``PDSERVE_DASHBOARD_PNG=docs/img/dashboard.png`` also draws the
dashboard from the same Prometheus's range queries (benchmarks/dashboard_png.py).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from benchmarks import dashboard_png
from cluster.routing.flow import FlowStatus
from cluster.routing.metrics import GAUGE_KEYS, TOTAL_KEYS
from tests.helpers.cluster import metric_value, tiny_cluster_config, wait_all_kv_free, wait_until
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
JOB = "pdserve"
VARIABLES = {"job": JOB, "__rate_interval": "2m", "datasource": "prometheus"}  # the window covers the whole load
PROMETHEUS_START_S = 30.0
SELECTOR = re.compile(r"\b(pdserve_\w+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"([^"]*)"')
GROUPING = re.compile(r"\b(?:by|without|ignoring|on)\s*\(([^)]*)\)")
DECODE_KV_BLOCKS = 24  # 384 tokens: a burst request (200 + 150 tokens) takes a decode worker's whole cache


@pytest.fixture(scope="module")
def cluster(tiny_llama_path):
    from cluster.run.launch import start_serving

    config = tiny_cluster_config(
        tiny_llama_path,
        pools={
            "prefill": {"replicas": 1, "torch_threads": 1, "kv_blocks": 96},
            "decode": {"replicas": 2, "torch_threads": 1, "kv_blocks": DECODE_KV_BLOCKS},
        },
        router={"port": 0, "queue_size": 0},
    )
    handle = start_serving(config, in_process=True)
    try:
        yield handle
        wait_all_kv_free(handle.base_url)
        assert not handle.router.flows
    finally:
        handle.stop()


def _complete(handle, prompt: list[int], max_tokens: int, client: httpx.Client | None = None) -> httpx.Response:
    body = {
        "model": handle.config.served_model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return (client or httpx).post(f"{handle.base_url}/v1/completions", json=body, timeout=60)


def _families(base_url: str) -> dict[str, set[str]]:
    """Each metric family the router serves and the label names its samples carry (a family whose labelled
    children are not made yet has none), by sample name (``_bucket``, ``_total`` ... too)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ())
        for name in (family.name, *(family.name + suffix for suffix in suffixes)):
            out.setdefault(name, set())
        for sample in family.samples:
            out.setdefault(sample.name, set()).update(sample.labels)
    return out


def _targets(dashboard: dict) -> list[tuple[str, dict]]:
    return [(panel["title"], target) for panel in dashboard_png.panels(dashboard) for target in panel["targets"]]


# ---- always ---------------------------------------------------------------------------------------------------


def test_the_dashboard_is_well_formed_and_every_panel_has_queries():
    dashboard = dashboard_png.load()
    assert 36 <= dashboard["schemaVersion"] <= 41 and dashboard["uid"] == "pdserve"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["job"]["datasource"]["uid"] == "${datasource}"
    panels = dashboard_png.panels(dashboard)
    assert len(panels) >= 20 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= dashboard_png.GRID_COLUMNS, panel["title"]
        mine = {
            (x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["description"], panel["title"]
        assert panel["targets"] and len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        for target in panel["targets"]:
            expr = target["expr"]
            assert expr.count("(") == expr.count(")") and "$job" in expr, (panel["title"], expr)
            unknown = set(re.findall(r"\$\{?(\w+)", expr)) - set(VARIABLES)
            assert not unknown, (panel["title"], unknown)
    assert "localhost:8000" in SCRAPE_CONFIG.read_text()


def test_every_metric_and_label_the_queries_name_is_served(cluster):
    assert _complete(cluster, random_prompts(1, 30, 30, seed=5)[0], 4).status_code == 200
    wait_until(lambda: "pdserve_worker" in _families(cluster.base_url), timeout_s=10)  # a heartbeat came
    families = _families(cluster.base_url)
    for title, target in _targets(dashboard_png.load()):
        expr = target["expr"]
        grouped = {name.strip() for group in GROUPING.findall(expr) for name in group.split(",") if name.strip()}
        labels_seen: set[str] = {"job", "instance", "le"}
        for name, matchers in SELECTOR.findall(expr):
            assert name in families, f"{title}: {name} is not in /metrics"
            labels_seen |= families[name]
            for label, value in MATCHER.findall(matchers):
                if label == "key":
                    keys = GAUGE_KEYS if name == "pdserve_worker" else TOTAL_KEYS
                    assert set(value.split("|")) <= set(keys), f"{title}: {name} has no key {value!r}"
                elif label != "job":
                    assert not families[name] or label in families[name], f"{title}: {name} has no label {label}"
        # a label grouped by, or shown in the legend, is on one of the query's metrics (where its samples exist)
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
        missing = (grouped | legend) - labels_seen
        unlabelled = [n for n, _ in SELECTOR.findall(expr) if not families[n]]
        assert not missing or unlabelled, f"{title}: {sorted(missing)} on none of its metrics"


def test_the_renderer_draws_every_panel_from_query_results(tmp_path):
    asked: list[str] = []

    def query(expr: str, start: float, end: float, step: float) -> list[dict]:
        asked.append(expr)
        return [{"metric": {"stage": "prefill_queue"}, "values": [[start, "0.5"], [end, "NaN"], [end, "1"]]}]

    out = tmp_path / "dashboard.png"
    drawn = dashboard_png.render(query, 1000.0, 1060.0, out, VARIABLES)
    targets = _targets(dashboard_png.load())
    assert drawn == len(asked) == len(targets) and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any("$" in expr for expr in asked) and 'job=~"pdserve"' in asked[0]


# ---- with a real Prometheus ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _prometheus(binary: str, target: str, folder: Path) -> Iterator[str]:
    """A Prometheus on 127.0.0.1 scraping ``target`` every second (the repo's scrape config, its target and interval
    replaced); its URL once ready. Stopped by its pid."""
    config = SCRAPE_CONFIG.read_text().replace("localhost:8000", target)
    config = re.sub(r"scrape_interval: \w+", "scrape_interval: 1s", config)
    (folder / "prometheus.yml").write_text(config)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(folder / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:

        def ready() -> bool:
            assert proc.poll() is None, (folder / "prometheus.log").read_text()[-3000:]
            try:
                return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout_s=PROMETHEUS_START_S, step_s=0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        log.close()


def _query(url: str, expr: str) -> list[dict]:
    body = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _move_a_stream(handle) -> None:
    """A long completion whose stream is moved to the other decode worker mid-way."""
    done: list[httpx.Response] = []
    runner = threading.Thread(target=lambda: done.append(_complete(handle, random_prompts(1, 20, 20, seed=9)[0], 160)))
    runner.start()

    def decoding():
        flows = [f for f in handle.router.core.flows.values() if f.status is FlowStatus.DECODING]
        return flows[0] if flows and flows[0].received_tokens >= 5 else None

    wait_until(lambda: decoding() is not None, timeout_s=30, step_s=0.01)
    flow = decoding()
    response = httpx.post(
        f"{handle.base_url}/admin/migrate", json={"request_id": flow.rid}, headers=handle.admin_headers, timeout=10
    )
    assert response.status_code == 200, response.text
    runner.join(timeout=60)
    assert done and done[0].status_code == 200, done and done[0].text


def _burst(handle, count: int = 4) -> list[int]:
    """Requests that each take a decode worker's whole KV cache, at once: with a queue of 0, those past the two
    decode workers are refused (429)."""

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            bodies = [
                {"model": handle.config.served_model_name, "prompt": p, "max_tokens": 150, "ignore_eos": True}
                for p in random_prompts(count, 200, 200, seed=11)
            ]
            replies = await asyncio.gather(*(client.post(f"{handle.base_url}/v1/completions", json=b) for b in bodies))
            return sorted(r.status_code for r in replies)

    return asyncio.run(run())


def test_every_panel_returns_data_from_a_real_prometheus(cluster, tmp_path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "no `prometheus` binary on the PATH (Debian: apt-get install prometheus); the dashboard's "
            "queries were checked against /metrics only"
        )
    target = urlsplit(cluster.base_url).netloc
    with _prometheus(binary, target, tmp_path) as url:
        wait_until(lambda: any(s["value"][1] == "1" for s in _query(url, f'up{{job="{JOB}"}}')), timeout_s=20)
        started = time.time()
        out = os.environ.get("PDSERVE_DASHBOARD_PNG")
        rounds = 6 if out else 1  # the picture for the docs: a longer load, so that its lines show a shape
        for index in range(rounds):
            repeated = random_prompts(1, 64, 64, seed=3 + index)[0]
            with httpx.Client() as client:
                for prompt in random_prompts(4, 30, 60, seed=20 + index) + [repeated, repeated]:  # a prefix hit
                    assert _complete(cluster, prompt, 12 + 8 * index, client).status_code == 200
            if index == rounds // 2:
                _move_a_stream(cluster)
                codes = _burst(cluster)
                assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
                refused = httpx.post(  # refused by the API before the router: an HTTP error by status
                    f"{cluster.base_url}/v1/completions",
                    json={"model": cluster.config.served_model_name, "prompt": "x", "max_tokens": -1},
                    timeout=30,
                )
                assert refused.status_code == 400, refused.text
            wait_all_kv_free(cluster.base_url)
        # a scrape after the load's end: the router's counts, and the workers' from a heartbeat after it
        ended = metric_value(cluster.base_url, "pdserve_requests_total", outcome="error")
        wait_until(lambda: _query(url, f'pdserve_requests_total{{outcome="error"}} == {ended}'), timeout_s=10)
        time.sleep(1.5)
        empty = []
        for title, target_ in _targets(dashboard_png.load()):
            expr = dashboard_png.substitute(target_["expr"], VARIABLES)
            result = _query(url, expr)
            if not any(math.isfinite(float(s["value"][1])) for s in result):
                empty.append(f"{title} [{target_['refId']}]: {expr} -> {result}")
        assert not empty, "\n".join(empty)
        if out:
            query = dashboard_png.prometheus_range_query(url)
            variables = VARIABLES | {"__rate_interval": "5s"}
            dashboard_png.render(query, started - 5, time.time(), Path(out), variables)
