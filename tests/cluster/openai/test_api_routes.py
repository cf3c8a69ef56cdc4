"""The HTTP routes that need no generation, each on its own: ``create_app`` around a stand-in router and tokenizer, no
cluster, no model (cluster/openai/api.py). What they answer, with which status and OpenAI error body."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from starlette.testclient import TestClient

from cluster.admin_token import admin_token
from cluster.config import parse_config
from cluster.openai.api import create_app
from cluster.routing.errors import ScaleError
from cluster.routing.metrics import RouterMetrics

KEY = "k" * 32
AUTH = {"authorization": f"Bearer {KEY}"}


@dataclass
class Worker:
    name: str
    role: str
    alive: bool = True
    degraded: str | None = None


@dataclass
class Members:
    workers: dict[str, Worker]


class Metrics:
    def __init__(self) -> None:
        self.http_errors = RouterMetrics().http_errors  # every error body the API answers with is counted

    def render(self) -> bytes:
        return b"pdserve_requests_total 3\n"


class Scaler:
    def __init__(self) -> None:
        self.asked: list[tuple] = []

    async def scale_async(self, pool, replicas, drain_timeout_s):
        self.asked.append((pool, replicas, drain_timeout_s))
        if pool != "decode":
            raise ScaleError("pool", f"no pool named {pool!r}")
        return {"decode": replicas}


@dataclass
class FakeRouter:
    """The parts of ``Router`` these routes call."""

    live_roles: set[str] = field(default_factory=lambda: {"prefill", "decode", "colocated"})
    members: Members = field(
        default_factory=lambda: Members({name: Worker(name, name.split("-")[0]) for name in ("prefill-0", "decode-0")})
    )
    metrics: Metrics = field(default_factory=Metrics)
    scaler: Scaler | None = field(default_factory=Scaler)
    moves: list[tuple] = field(default_factory=list)
    lifecycle: list[str] = field(default_factory=list)
    tracing: None = None  # request traces off (worker/tracing.py)

    async def start(self) -> None:
        self.lifecycle.append("start")

    async def close(self) -> None:
        self.lifecycle.append("close")

    def live(self, role: str) -> bool:
        return role in self.live_roles

    def status(self) -> dict:
        return {"workers": len(self.members.workers)}

    def migrate(self, request_id, worker, target) -> dict:
        self.moves.append((request_id, worker, target))
        return {} if request_id == "gone" else {request_id or "r-1": "moving"}


class FakeTokenizer:
    name_or_path = None  # no model folder: no generation_config.json, no KV sizing in /status

    def __len__(self) -> int:
        return 100


SECRET = "a-cluster-secret-of-this-test-00"
ADMIN = {"Authorization": f"Bearer {admin_token(SECRET)}"}  # what pdserve serve writes to its token file


def client(router: FakeRouter, admin: bool = False, **router_section) -> TestClient:
    """``admin``: every request carries the admin token (the cluster has no API key)."""
    config = parse_config({"router": {"served_model_name": "m", **router_section}, "transfer": {"secret": SECRET}})
    return TestClient(create_app(router, FakeTokenizer(), config, max_model_len=64), headers=ADMIN if admin else None)


def error(response) -> dict:
    return response.json()["error"]


def test_health_is_open_and_says_which_workers_are_unwell():
    router = FakeRouter()
    with client(router, api_key=KEY) as http:
        assert http.get("/health").json() == {"status": "ok", "mode": "disaggregated", "unhealthy_workers": {}}
        router.members.workers["decode-0"].degraded = "slow steps"
        router.members.workers["prefill-0"].alive = False
        router.live_roles.discard("prefill")
        answer = http.get("/health")
    assert answer.status_code == 503
    assert answer.json()["unhealthy_workers"] == {"decode-0": "slow steps", "prefill-0": "dead"}
    assert router.lifecycle == ["start", "close"]  # the app's lifespan starts and closes the router


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/status"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("POST", "/admin/scale"),
        ("POST", "/v1/completions"),
    ],
)
def test_every_route_but_health_needs_the_key_before_reading_the_body(method, path):
    http = client(FakeRouter(), api_key=KEY)
    for headers in ({}, {"authorization": "Bearer wrong"}):
        answer = http.request(method, path, content=b"not even JSON", headers=headers)
        assert answer.status_code == 401 and error(answer)["code"] == "invalid_api_key"
    assert http.request(method, path, content=b"not even JSON", headers=AUTH).status_code != 401


def test_status_metrics_and_models_answer_for_the_router():
    http = client(FakeRouter())
    assert http.get("/status").json() == {"workers": 2, "kv": None}
    metrics = http.get("/metrics")
    assert metrics.text == "pdserve_requests_total 3\n" and metrics.headers["content-type"].startswith("text/plain")
    assert http.get("/v1/models").json()["data"] == [
        {"id": "m", "object": "model", "created": 0, "owned_by": "pdserve", "max_model_len": 64}
    ]


def test_admin_routes_take_a_credential_even_on_loopback():
    """Without an API key, /admin/* takes the token derived from the cluster secret (any local process could
    connect); with one, the API key; the other routes stay open without a key."""
    router = FakeRouter()
    http = client(router)
    for path, body in (("/admin/scale", {"pool": "decode", "replicas": 3}), ("/admin/migrate", {"worker": "decode-0"})):
        for headers in ({}, {"authorization": "Bearer wrong"}):
            answer = http.post(path, json=body, headers=headers)
            assert answer.status_code == 401 and error(answer)["type"] == "authentication_error"
        assert http.post(path, json=body, headers=ADMIN).status_code == 200
    assert router.scaler is not None and router.scaler.asked == [("decode", 3, None)] and len(router.moves) == 1
    assert http.get("/status").status_code == 200
    keyed = client(FakeRouter(), api_key=KEY)
    assert keyed.post("/admin/scale", json={"pool": "decode", "replicas": 3}, headers=ADMIN).status_code == 401
    assert keyed.post("/admin/scale", json={"pool": "decode", "replicas": 3}, headers=AUTH).status_code == 200
    unset = create_app(FakeRouter(), FakeTokenizer(), parse_config({}), max_model_len=64)  # no secret: closed
    assert TestClient(unset).post("/admin/scale", json={"pool": "decode", "replicas": 3}).status_code == 401


def test_admin_scale_passes_the_request_on_and_names_a_refused_field():
    router = FakeRouter()
    http = client(router, admin=True)
    assert http.post("/admin/scale", json={"pool": "decode", "replicas": 3}).json() == {"decode": 3}
    refused = http.post("/admin/scale", json={"pool": "prefil", "replicas": 1})
    assert refused.status_code == 400 and error(refused)["param"] == "pool"
    unknown = http.post("/admin/scale", json={"pool": "decode", "replica": 1})
    assert unknown.status_code == 400 and error(unknown)["param"] == "replica"
    assert router.scaler is not None and router.scaler.asked == [("decode", 3, None), ("prefil", 1, None)]
    router.scaler = None
    cannot = http.post("/admin/scale", json={"pool": "decode", "replicas": 3})
    assert cannot.status_code == 503 and error(cannot)["type"] == "server_error"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"request_id": "r-7"}, 200, None),
        ({"worker": "decode-0"}, 200, None),
        ({"request_id": "gone"}, 404, "request_id"),
        ({"worker": "prefill-0"}, 400, "worker"),
        ({"request_id": "r-7", "to": "decode-9"}, 400, "to"),
        ({"request_id": "r-7", "worker": "decode-0"}, 400, "request_id"),
        ({"worker": 3}, 400, "worker"),
        ({"request_id": "r-7", "why": "x"}, 400, "why"),
    ],
)
def test_admin_migrate_checks_its_body_before_moving_anything(body, status, param):
    router = FakeRouter()
    answer = client(router, admin=True).post("/admin/migrate", json=body)
    assert answer.status_code == status
    if status == 400:
        assert error(answer)["param"] == param and router.moves == []
    elif status == 404:
        assert error(answer)["param"] == param
    else:
        assert "moving" in answer.json()
        assert router.moves == [(body.get("request_id"), body.get("worker"), None)]


def test_unknown_routes_and_methods_get_an_openai_error_body():
    http = client(FakeRouter())
    missing = http.get("/v2/anything")
    assert missing.status_code == 404 and error(missing)["type"] == "not_found_error"
    wrong = http.get("/v1/completions")
    assert wrong.status_code == 405 and error(wrong)["type"] == "invalid_request_error"
