"""The Grafana dashboard (deploy/grafana/pdserve.json) drawn as a PNG from its own queries' results, for the docs.

Each panel's queries go to a Prometheus's range-query API with the dashboard's variables filled in (``substitute``);
the panels are laid out as the dashboard's grid places them. ``tests/deploy/test_dashboard.py`` runs it against a real
Prometheus that scraped a tiny cluster under load (``PDSERVE_DASHBOARD_PNG=docs/img/dashboard.png``); by hand:

    python -m benchmarks.dashboard_png --prometheus http://127.0.0.1:9090 --minutes 15 --out dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "pdserve.json"
GRID_COLUMNS = 24  # Grafana's grid width
UNIT_SCALE = {"s": (1000.0, "ms"), "Bps": (1 / 1024, "KiB/s"), "percentunit": (100.0, "%")}

# (expr, start, end, step) -> Prometheus's "result" of a range query: [{"metric": {...}, "values": [[t, "v"], ...]}]
RangeQuery = Callable[[str, float, float, float], list[dict]]


def load(path: Path = DASHBOARD) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> list[dict]:
    """The panels that draw something (rows left out), in the dashboard's order."""
    return [p for p in dashboard["panels"] if p.get("type") != "row"]


def substitute(expr: str, variables: dict[str, str]) -> str:
    """``$name`` and ``${name}`` filled in, as Grafana does before it sends a query (``__rate_interval`` included)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m.group(1) or m.group(2)], expr)


def prometheus_range_query(url: str, timeout_s: float = 10.0) -> RangeQuery:
    def query(expr: str, start: float, end: float, step: float) -> list[dict]:
        params = {"query": expr, "start": start, "end": end, "step": step}
        body = httpx.get(f"{url}/api/v1/query_range", params=params, timeout=timeout_s).json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('error')}")
        return body["data"]["result"]

    return query


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template) or str(labels)


def render(
    query: RangeQuery,
    start: float,
    end: float,
    out: Path,
    variables: dict[str, str],
    dashboard: dict | None = None,
    step: float = 1.0,
) -> int:
    """Draw every panel into ``out``; returns the number of series drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = dashboard or load()
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    unit_h = 0.32  # inches per grid row (Grafana's 30 px)
    fig = plt.figure(figsize=(18, bottom * unit_h))
    fig.suptitle(
        f"{dashboard['title']} ({time.strftime('%Y-%m-%d %H:%M', time.localtime(end))}, {round(end - start)} s)",
        y=1 - 0.2 / (bottom * unit_h),
        fontsize=12,
    )
    drawn = 0
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        left, width = grid["x"] / GRID_COLUMNS, grid["w"] / GRID_COLUMNS
        top = 1 - grid["y"] / bottom
        if panel.get("type") == "row":
            fig.text(0.005, top - 0.5 / bottom, panel["title"], fontsize=11, weight="bold", va="center")
            continue
        # room inside the cell for the title, tick labels and the legend
        ax = fig.add_axes((left + 0.035, top - (grid["h"] - 1.6) / bottom, width - 0.05, (grid["h"] - 3.2) / bottom))
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        scale, unit_label = UNIT_SCALE.get(unit, (1.0, unit if unit not in ("short", "reqps") else ""))
        if unit == "reqps":
            unit_label = "req/s"
        for target in panel["targets"]:
            for series in query(substitute(target["expr"], variables), start, end, step):
                points = [(float(t) - end, float(v) * scale) for t, v in series["values"]]
                finite = [(t, v) for t, v in points if math.isfinite(v)]
                if not finite:
                    continue
                xs, ys = zip(*finite)
                ax.plot(xs, ys, linewidth=1.2, label=legend(target.get("legendFormat", ""), series["metric"]))
                drawn += 1
        ax.set_title(panel["title"], fontsize=9, loc="left")
        ax.set_ylabel(unit_label, fontsize=7)
        ax.tick_params(labelsize=7)
        ax.set_xlim(start - end, 0)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2, frameon=False)
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center", color="grey")
    fig.text(0.5, 0.002, "seconds before the end of the window", ha="center", fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return drawn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--minutes", type=float, default=15.0, help="the window: this many minutes up to now")
    parser.add_argument("--job", default="pdserve", help="the dashboard's job variable (a regex)")
    parser.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--out", type=Path, default=Path("dashboard.png"))
    args = parser.parse_args(argv)
    end = time.time()
    start = end - args.minutes * 60
    step = max(1.0, (end - start) / 300)
    variables = {"job": args.job, "__rate_interval": args.rate_interval, "datasource": "prometheus"}
    drawn = render(prometheus_range_query(args.prometheus), start, end, args.out, variables, step=step)
    print(f"{args.out}: {drawn} series")


if __name__ == "__main__":
    main()
