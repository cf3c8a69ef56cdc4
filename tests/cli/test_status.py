"""``pdserve status``: one GET of a router's ``/status``, printed as a table or as the JSON, with clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

from cli.main import main
from tests.helpers.status_server import StatusServer, canned_status


def test_status_prints_the_routers_totals_and_one_line_per_worker(status_server, capsys, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    server = status_server()
    assert main(["status", "--url", server.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    payload = canned_status()
    assert lines[0].split() == [
        "mode:",
        payload["mode"],
        "model:",
        payload["model"],
        "in",
        "flight:",
        str(payload["inflight"]),
        "queued:",
        str(payload["queue_depth"]),
    ]
    router = payload["router"]
    assert f"router process {router['index']} of {router['processes']} (pid {router['pid']})" in lines[1]
    assert lines[1].endswith(f"queued in all: {router['queue_depth_all']}")
    assert lines[2].split() == [
        "worker",
        "role",
        "alive",
        "waiting",
        "running",
        "kv",
        "free",
        "transfers",
        "kv",
        "bytes",
    ]
    by_name = {line.split()[0]: line.split() for line in lines[3:]}
    assert set(by_name) == {w["name"] for w in payload["workers"]}
    seen, fresh = payload["workers"]
    assert by_name[seen["name"]] == [
        seen["name"],
        seen["role"],
        str(seen["alive"]),
        str(seen["waiting"]),
        str(seen["running"]),
        f"{seen['free_blocks']}/{seen['total_blocks']}",
        str(int(seen["transfers_ok"])),
        str(int(seen["transfer_bytes"])),
    ]
    # no heartbeat yet: no load figures, and the table says so instead of failing
    assert by_name[fresh["name"]] == [fresh["name"], fresh["role"], "False", "0", "0", "?/?", "0", "0"]
    assert server.authorizations == [None]  # no key configured: none sent


def test_status_json_is_the_routers_answer(status_server, capsys, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    server = status_server()
    assert main(["status", "--url", server.url + "/", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == canned_status()


def test_status_sends_the_api_key_and_explains_a_refusal(status_server, capsys, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    server = status_server(api_key="s3cret")
    assert main(["status", "--url", server.url]) == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "--api-key" in err and "PDSERVE_API_KEY" in err
    assert main(["status", "--url", server.url, "--api-key", "s3cret"]) == 0
    assert "prefill-0" in capsys.readouterr().out
    monkeypatch.setenv("PDSERVE_API_KEY", "s3cret")
    assert main(["status", "--url", server.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "disaggregated"
    assert server.authorizations == [None, "Bearer s3cret", "Bearer s3cret"]


def test_a_router_that_does_not_answer_in_time_is_a_clear_error(status_server, capsys, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    server = status_server(delay_s=2.0)
    assert main(["status", "--url", server.url, "--timeout", "0.3"]) == 2
    err = capsys.readouterr().err
    assert "no pdserve router answers" in err and "timed out" in err


def test_status_without_a_server_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "status", "--url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "no pdserve router answers" in result.stderr and "Traceback" not in result.stderr


def test_status_prints_the_served_models_kv_sizing(capsys, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    payload = canned_status()
    payload["kv"] = {
        "dtype": "bfloat16",
        "bytes_per_token": 131072,
        "tokens_per_gib": 8192,
        "block_size": 16,
        "pools": {"prefill": {"blocks": 100, "tokens": 1600}, "decode": {"blocks": 400, "tokens": 6400}},
    }
    with StatusServer(payload) as server:
        assert main(["status", "--url", server.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    kv_line = next(line for line in lines if line.startswith("kv:"))
    assert kv_line == (
        "kv: 131,072 B/token (bfloat16), 8,192 tokens/GiB, blocks of 16; "
        "prefill 100 blocks = 1,600 tokens per replica; decode 400 blocks = 6,400 tokens per replica"
    )
    assert lines.index(kv_line) + 1 == next(i for i, line in enumerate(lines) if line.startswith("worker"))


def test_status_marks_a_worker_switching_role_with_its_phase():
    from cli.status import format_status

    payload = canned_status()
    payload["pools"] = {
        "decode": {"replicas": 1, "workers": ["decode-1"], "draining": ["decode-1"], "switching": ["decode-1"]}
    }
    payload["workers"][0]["switch"] = {"to": "prefill", "phase": "reconfiguring", "elapsed_s": 1.25}
    lines = format_status(payload).splitlines()
    worker = next(line for line in lines if line.startswith(payload["workers"][0]["name"]))
    assert worker.endswith("switching to prefill: reconfiguring (1.2 s)")
