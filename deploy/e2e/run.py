"""``make cluster-e2e``: pdserve on separate hosts started by ``ray up``, checked end to end, under network faults.

Steps (each recorded in one JSON summary on stdout; progress on stderr):
1. hosts: a head and three worker hosts as namespaces (deploy/e2e/hosts.py), each with its own address and sshd.
2. ``ray up`` with Ray's local provider (configs/cluster-local.yaml; token authentication on every node), then
   ``pdserve serve --address auto`` on the head through ``ray exec``, with an API key, on the head's own address.
3. checks: the official ``openai`` client; greedy output over HTTP against transformers on the same weights; which
   host each worker runs on; the API without its key; a Ray client without the token from another host.
4. faults under load from ``pdserve bench serve``: delay and loss (``tc netem``, or iptables for the loss where the
   kernel has no netem), a host's link cut, a route cut between two hosts.
5. ``pdserve scale`` of the decode pool beyond what the running hosts hold (the autoscaler starts the spare host),
   then of the prefill pool onto the spare's second CPU: how KV goes within a host and across hosts.
6. ``ray down`` and the hosts' removal, always (a failure, Ctrl-C or SIGTERM included); then a check that no
   namespace, bridge or state folder is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
import hosts  # noqa: E402
from verdict import failed_parts  # noqa: E402

VENV = ROOT / ".venv" / "bin"
CLUSTER_YAML = ROOT / "configs" / "cluster-local.yaml"
SERVE_YAML = ROOT / "deploy" / "e2e" / "serve.yaml"
HEAD = hosts.BY_NAME["head"]
BASE_URL = f"http://{HEAD.ip}:8000"
API_KEY = os.urandom(16).hex()
PROMPT = "The three primary colours are"


def log(message: str) -> None:
    print(f"cluster-e2e {time.strftime('%H:%M:%S')}: {message}", file=sys.stderr, flush=True)


def ray_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    # autoscaler v2 (Ray's default since 2.50) takes the local provider's head for a vanished worker and never
    # starts the second of min_workers (seen with Ray 2.60): v1 runs the local provider as documented
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_UP_enable_autoscaler_v2": "0"}
    return subprocess.run(
        [str(VENV / "ray"), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def headers(key: str | None = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str, every_s: float = 1.0) -> float:
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)
    return time.monotonic() - start


def get(path: str, key: str | None = API_KEY, timeout: float = 10) -> httpx.Response:
    return httpx.get(f"{BASE_URL}{path}", headers=headers(key), timeout=timeout)


def healthy() -> bool:
    try:
        return get("/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def ray_nodes() -> int:
    """Live Ray nodes, as a driver on the head counts them (with the token, as every process there has it)."""
    count = (
        "import ray; ray.init(address='auto', logging_level='ERROR', log_to_driver=False); "
        "print('nodes', sum(1 for n in ray.nodes() if n['Alive']))"
    )
    command = f'RAY_AUTH_MODE=token /work/main/.venv/bin/python -c "{count}"'
    result = ray_cli("exec", str(CLUSTER_YAML), command, timeout=120)
    found = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("nodes ")]
    return int(found[-1]) if found else 0


# ---- steps -----------------------------------------------------------------------------------------------------


def start_cluster(summary: dict) -> None:
    log("hosts up")
    started = time.monotonic()
    hosts.up()
    summary["hosts"] = {h.name: h.ip for h in hosts.HOSTS}
    summary["hosts_up_s"] = round(time.monotonic() - started, 1)
    log("ray up")
    started = time.monotonic()
    result = ray_cli("up", "-y", "--no-config-cache", str(CLUSTER_YAML), timeout=900)
    (hosts.STATE / "ray-up.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"ray up failed ({result.returncode}): {(result.stdout + result.stderr)[-2000:]}")
    # the two worker hosts of min_workers join through the head's autoscaler
    summary["ray_up_s"] = round(time.monotonic() - started, 1)
    summary["ray_nodes_ready_s"] = round(wait_for(lambda: ray_nodes() >= 3, 300, "3 Ray nodes", every_s=5), 1)
    log("pdserve serve on the head, through ray exec")
    command = (
        f"cd {ROOT} && PDSERVE_API_KEY={API_KEY} nohup .venv/bin/pdserve serve --config {SERVE_YAML} "
        "--address auto > /tmp/pdserve-serve.log 2>&1 &"
    )
    result = ray_cli("exec", str(CLUSTER_YAML), command, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"ray exec pdserve serve failed: {result.stderr[-2000:]}")
    summary["serve_ready_s"] = round(wait_for(healthy, 400, "pdserve /health", every_s=2), 1)


def workers_by_host() -> dict[str, list[str]]:
    by_ip = {h.ip: h.name for h in hosts.HOSTS}
    placed: dict[str, list[str]] = {}
    for worker in get("/status").json()["workers"]:
        address = worker.get("address", "")
        ip = address.split("//")[-1].rsplit(":", 1)[0]
        placed.setdefault(by_ip.get(ip, ip), []).append(worker["name"])
    return placed


def check_placement(summary: dict) -> None:
    placed = workers_by_host()
    status = get("/status").json()
    paths = {w["name"]: w.get("kv_paths", {}) for w in status["workers"] if w.get("kv_paths")}
    summary["placement"] = {
        "workers_by_host": placed,
        "prefill_and_decode_on_different_hosts": bool(
            {n for n, ws in placed.items() if any(w.startswith("prefill") for w in ws)}.isdisjoint(
                {n for n, ws in placed.items() if any(w.startswith("decode") for w in ws)}
            )
        ),
        "kv_paths": paths,
    }


def check_openai(summary: dict) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key=API_KEY, timeout=60, max_retries=0)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0
    )
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0, stream=True
        )
        if chunk.choices
    )
    summary["openai_client"] = {
        "model": model,
        "completion_tokens": completion.usage.completion_tokens if completion.usage else None,
        "chat_text": chat.choices[0].message.content,
        "stream_equals_non_stream": streamed == chat.choices[0].message.content,
        "ok": bool(completion.choices[0].text) and streamed == chat.choices[0].message.content,
    }
    summary["greedy_vs_transformers"] = greedy_vs_transformers(client, model)


def greedy_vs_transformers(client, model: str) -> dict:
    """The served model's greedy tokens over HTTP (from the head) against transformers here on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.model_loader import resolve_model_path  # the served model's folder (converted once into the cache)

    path = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    prompt_ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False)
    expected = out[0, len(prompt_ids) :].tolist()
    served = client.completions.create(model=model, prompt=prompt_ids, max_tokens=32, temperature=0, logprobs=0)
    served_text = served.choices[0].text
    expected_text = tokenizer.decode(expected, skip_special_tokens=True)
    return {"tokens": len(expected), "equal": served_text == expected_text, "served": served_text}


def check_auth(summary: dict) -> None:
    without_key = get("/v1/models", key=None)
    wrong_key = get("/v1/models", key="not-the-key")
    probe = (
        "import sys; from cluster.config import load_config; from cluster.run.ray_cluster import check_ray_auth\n"
        "try:\n"
        f"    check_ray_auth(load_config('{SERVE_YAML}'), '{HEAD.ip}:6379')\n"
        "    print('refused')\n"
        "except Exception as exc:\n"
        "    print('answered:', exc)\n"
    )
    other = hosts.BY_NAME["w3"]  # another host's network; no token in its environment
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": "/nonexistent"}
    result = subprocess.run(
        ["ip", "netns", "exec", other.netns, str(VENV / "python"), "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    answer = (result.stdout.strip().splitlines() or [result.stderr[-300:]])[-1]
    summary["auth"] = {
        "api_without_key": without_key.status_code,
        "api_wrong_key": wrong_key.status_code,
        "ray_client_without_token_from_w3": answer,
        "ok": without_key.status_code == 401 and wrong_key.status_code == 401 and answer == "refused",
    }


def check_scale(summary: dict) -> None:
    """A second decode replica needs a CPU that no running host has free: only the spare (w3) can bring one."""
    log("scale decode 1 -> 2 (every running worker host is full: the autoscaler must start w3)")
    started = time.monotonic()
    box: dict = {}

    def scale() -> None:
        try:
            r = httpx.post(
                f"{BASE_URL}/admin/scale", json={"pool": "decode", "replicas": 2}, headers=headers(), timeout=600
            )
            box["status"], box["body"] = r.status_code, r.json()
        except httpx.HTTPError as exc:
            box["error"] = str(exc)

    thread = threading.Thread(target=scale, daemon=True)
    thread.start()
    thread.join(timeout=420)

    def decode_workers() -> int:
        return sum(len([w for w in ws if w.startswith("decode")]) for ws in workers_by_host().values())

    try:  # the new worker serves once Ray placed it: on the spare host, if the autoscaler started it
        ready_s = round(time.monotonic() - started + wait_for(lambda: decode_workers() >= 2, 300, "decode-1"), 1)
    except TimeoutError:
        ready_s = None
    ray_status = ray_cli("exec", str(CLUSTER_YAML), "RAY_AUTH_MODE=token /work/main/.venv/bin/ray status", timeout=60)
    text = ray_status.stdout
    summary["scale"] = {
        "answer": box,
        "new_worker_serving_after_s": ready_s,
        "nodes_after": ray_nodes(),
        "workers_by_host": workers_by_host(),
        "ray_status": text[text.find("Node status") :].strip()[:1500],
    }
    summary["kv_paths_by_host_pair"] = same_and_cross_host_paths()


def same_and_cross_host_paths() -> dict:
    """A second prefill worker joins the spare host's free CPU, beside the new decode worker: requests then go from
    each prefill worker to both decode workers, and each sender says how it reaches each receiver."""
    log("scale prefill 1 -> 2 (the spare host's second CPU: a prefill and a decode worker on one host)")
    r = httpx.post(f"{BASE_URL}/admin/scale", json={"pool": "prefill", "replicas": 2}, headers=headers(), timeout=600)
    body = {"model": "smollm2-135m-instruct", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(max_workers=8) as pool:  # concurrent, so that the policies spread them over the pairs
        codes = list(
            pool.map(
                lambda _: (
                    httpx.post(f"{BASE_URL}/v1/completions", json=body, headers=headers(), timeout=120).status_code
                ),
                range(32),
            )
        )
    by_ip = {h.ip: h.name for h in hosts.HOSTS}
    status = get("/status").json()
    host_of = {w["name"]: by_ip.get(w.get("address", "").split("//")[-1].rsplit(":", 1)[0]) for w in status["workers"]}
    pairs = []
    for worker in status["workers"]:
        for address, path in (worker.get("kv_paths") or {}).items():
            receiver_host = by_ip.get(address.split("//")[-1].rsplit(":", 1)[0])
            pairs.append(
                {
                    "sender": worker["name"],
                    "sender_host": host_of[worker["name"]],
                    "receiver_host": receiver_host,
                    "path": path,
                }
            )
    # same host: the payload straight into the receiver's cache (transfer/direct_path.py); across hosts: in the frames
    expected = lambda p: "shm-direct" if p["sender_host"] == p["receiver_host"] else "inline"  # noqa: E731
    return {
        "scale_status": r.status_code,
        "requests_ok": sum(c == 200 for c in codes),
        "pairs": pairs,
        "same_host_pairs": sum(p["sender_host"] == p["receiver_host"] for p in pairs),
        "ok": bool(pairs)
        and all(p["path"] == expected(p) for p in pairs)
        and any(p["sender_host"] == p["receiver_host"] for p in pairs),
    }


# ---- faults ----------------------------------------------------------------------------------------------------


def netns(host: hosts.Host, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", host.netns, *args], check=True, timeout=10, capture_output=True)


def netem_available() -> bool:
    """Whether this kernel has ``sch_netem`` (a container's kernel may lack it, with no module to load)."""
    host = hosts.BY_NAME["w3"]
    probe = subprocess.run(
        ["ip", "netns", "exec", host.netns, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.returncode == 0:
        subprocess.run(["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", "lo", "root"], check=False)
    return probe.returncode == 0


@contextlib.contextmanager
def netem(names: list[str], rule: list[str]) -> Iterator[None]:
    """``tc netem`` on both ends of each host's link (so both directions see it)."""
    chosen = [hosts.BY_NAME[n] for n in names]
    try:
        for host in chosen:
            subprocess.run(["tc", "qdisc", "add", "dev", host.veth, "root", "netem", *rule], check=True, timeout=10)
            netns(host, "tc", "qdisc", "add", "dev", "eth0", "root", "netem", *rule)
        yield
    finally:
        for host in chosen:
            subprocess.run(["tc", "qdisc", "del", "dev", host.veth, "root"], check=False, timeout=10)
            subprocess.run(
                ["ip", "netns", "exec", host.netns, "tc", "qdisc", "del", "dev", "eth0", "root"],
                check=False,
                capture_output=True,
            )


@contextlib.contextmanager
def random_loss(names: list[str], probability: float) -> Iterator[None]:
    """Packet loss without netem: iptables drops each packet in and out of each host with ``probability``."""
    chosen = [hosts.BY_NAME[n] for n in names]
    rule = ["-m", "statistic", "--mode", "random", "--probability", str(probability), "-j", "DROP"]
    try:
        for host in chosen:
            for chain in ("INPUT", "OUTPUT"):
                netns(host, "iptables", "-A", chain, "-i" if chain == "INPUT" else "-o", "eth0", *rule)
        yield
    finally:
        for host in chosen:
            for chain in ("INPUT", "OUTPUT"):
                subprocess.run(["ip", "netns", "exec", host.netns, "iptables", "-F", chain], check=False)


def cut_link(name: str, seconds: float) -> None:
    host = hosts.BY_NAME[name]
    subprocess.run(["ip", "link", "set", host.veth, "down"], check=True, timeout=10)
    try:
        time.sleep(seconds)
    finally:
        subprocess.run(["ip", "link", "set", host.veth, "up"], check=True, timeout=10)


def cut_pair(a: str, b: str, seconds: float) -> None:
    """Only the traffic between two hosts (blackhole routes on both), every other link as it was."""
    ha, hb = hosts.BY_NAME[a], hosts.BY_NAME[b]
    netns(ha, "ip", "route", "add", "blackhole", f"{hb.ip}/32")
    netns(hb, "ip", "route", "add", "blackhole", f"{ha.ip}/32")
    try:
        time.sleep(seconds)
    finally:
        subprocess.run(["ip", "netns", "exec", ha.netns, "ip", "route", "del", "blackhole", f"{hb.ip}/32"], check=False)
        subprocess.run(["ip", "netns", "exec", hb.netns, "ip", "route", "del", "blackhole", f"{ha.ip}/32"], check=False)


def load(duration_s: float, out: Path) -> subprocess.Popen:
    command = [
        str(VENV / "pdserve"),
        "bench",
        "serve",
        "--base-url",
        BASE_URL,
        "--model",
        "smollm2-135m-instruct",
        "--api-key",
        API_KEY,
        "--request-rate",
        "2",
        "--num-prompts",
        str(int(duration_s * 2)),  # every one is waited for (a duration bound would cancel those still running)
        "--random-input-len",
        "64",
        "--random-output-len",
        "32",
        "--request-timeout-s",
        "60",
        "--disable-tqdm",
        "--result-dir",
        str(out.with_suffix("")),
        "--json",
    ]
    return subprocess.Popen(command, stdout=out.open("w"), stderr=subprocess.DEVNULL, cwd=ROOT)


def router_counts() -> dict[str, float]:
    """The router's error and revival counters (``/metrics``), by label: what it did about the fault."""
    counts: dict[str, float] = {}
    for line in get("/metrics").text.splitlines():
        if line.startswith(("pdserve_errors_total{", "pdserve_worker_revivals_total ")):
            name, value = line.rsplit(" ", 1)
            counts[name] = float(value)
    return counts


def kv_held() -> dict:
    status = get("/status").json()
    decode = [w for w in status["workers"] if w.get("role") == "decode" and w.get("alive")]
    return {
        "inflight": status["inflight"],
        "decode_blocks_held": sum(w.get("total_blocks", 0) - w.get("free_blocks", 0) for w in decode),
    }


def recovered() -> bool:
    try:
        r = httpx.post(
            f"{BASE_URL}/v1/completions",
            json={"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 4},
            headers=headers(),
            timeout=15,
        )
        return r.status_code == 200
    except httpx.HTTPError:
        return False


def run_fault(name: str, inject: Callable[[], None], summary: dict, duration_s: float = 40) -> None:
    log(f"fault: {name}")
    out = hosts.STATE / f"bench-{name}.json"
    before, counts_before = get("/status").json(), router_counts()
    bench = load(duration_s, out)
    time.sleep(8)  # load first
    fault_start = time.monotonic()
    inject()
    healed = time.monotonic()
    recover_s = wait_for(recovered, 180, f"{name}: a request after the fault", every_s=0.5)
    try:
        bench.wait(timeout=duration_s + 200)
    except subprocess.TimeoutExpired:
        bench.kill()
    result = json.loads(out.read_text() or "{}") if out.exists() else {}
    run = (result.get("runs") or [{}])[0]
    measured = run.get("metrics", run)  # the loadtest's figures of its one measured phase
    settle_s = wait_for(lambda: kv_held() == {"inflight": 0, "decode_blocks_held": 0}, 120, f"{name}: KV released")
    after = get("/status").json()
    sent, completed, failed = measured.get("requests"), measured.get("completed"), measured.get("failed")
    summary.setdefault("faults", {})[name] = {
        "fault_s": round(healed - fault_start, 1),
        "sent": sent,
        "completed": completed,
        "failed": failed,
        "lost": None if None in (sent, completed, failed) else sent - completed - failed,
        "failures": measured.get("failures"),  # by error; a request that hung would be its timeout here
        "bench_exit": bench.returncode,
        "recover_s_after_heal": round(recover_s, 1),
        "kv_held_after": kv_held(),
        "kv_released_within_s": round(settle_s, 1),
        "router_counted": {
            k: v - counts_before.get(k, 0.0) for k, v in router_counts().items() if v != counts_before.get(k, 0.0)
        },
        "workers_alive_after": {w["name"]: w["alive"] for w in after["workers"]},
        # a worker Ray restarted comes back with a new command address
        "workers_restarted": sorted(
            w["name"]
            for w in after["workers"]
            for b in before["workers"]
            if w["name"] == b["name"] and w.get("address") != b.get("address")
        ),
    }


def faults(summary: dict) -> None:
    found = summary.setdefault("faults", {})
    if netem_available():
        with netem(["w1", "w2"], ["delay", "10ms"]):
            run_fault("delay_10ms", lambda: time.sleep(20), summary)
        with netem(["w1", "w2"], ["loss", "1%"]):
            run_fault("loss_1pct", lambda: time.sleep(20), summary)
    else:
        found["delay_10ms"] = {"skipped": "this kernel has no sch_netem (tc: 'Specified qdisc kind is unknown')"}
        with random_loss(["w1", "w2"], 0.01):  # the same loss, by iptables' statistic match
            run_fault("loss_1pct", lambda: time.sleep(20), summary)
        found["loss_1pct"]["injected_by"] = "iptables statistic (no netem)"
    run_fault("partition_decode_host_10s", lambda: cut_link("w2", 10), summary)
    run_fault("partition_head_prefill_10s", lambda: cut_pair("head", "w1", 10), summary)


# ---- the run ---------------------------------------------------------------------------------------------------


def teardown(summary: dict) -> None:
    log("ray down and hosts down")
    if hosts.STATE.exists():
        result = ray_cli("down", "-y", str(CLUSTER_YAML), timeout=300)
        summary["ray_down_rc"] = result.returncode
    hosts.down()
    for leftover in ("state", "lock"):  # what `ray up` kept here about the cluster
        with contextlib.suppress(FileNotFoundError):
            (Path("/tmp/ray") / f"cluster-pdserve-e2e.{leftover}").unlink()
    left = hosts.status()
    bridge = subprocess.run(["ip", "link", "show", hosts.BRIDGE], capture_output=True, check=False).returncode == 0
    summary["left_behind"] = {
        "namespaces": [n for n, s in left.items() if s["netns"]],
        "bridge": bridge,
        "state_folder": hosts.STATE.exists(),
    }


def main() -> int:
    if os.geteuid() != 0:
        sys.exit("make cluster-e2e needs root (namespaces, tc)")

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    summary: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    started = time.monotonic()
    steps = [
        start_cluster,
        check_openai,
        check_placement,  # after requests: the KV senders have sessions to report
        check_auth,
        faults,
        check_scale,
    ]
    only = set(os.environ.get("E2E_STEPS", "").split(",")) - {""}
    try:
        for step in steps:
            if only and step.__name__ not in only and step is not start_cluster:
                continue
            step(summary)
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - said in the summary; teardown runs
        summary["error"] = f"{type(exc).__name__}: {exc}"
        log(f"failed: {summary['error']}")
        with contextlib.suppress(Exception):
            summary["serve_log_tail"] = (hosts.BY_NAME["head"].home / "tmp" / "pdserve-serve.log").read_text()[-3000:]
    finally:
        if os.environ.get("E2E_KEEP") != "1":
            teardown(summary)
        summary["seconds"] = round(time.monotonic() - started, 1)
        # the conjunction of every part's own verdict (deploy/e2e/verdict.py)
        summary["failed_parts"] = failed_parts(summary)
        summary["ok"] = not summary["failed_parts"]
        print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] and not any(summary.get("left_behind", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
