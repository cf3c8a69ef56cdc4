"""The multi-turn chat workload (``--dataset-name multi-turn``): against the scripted server (the history really
carries the server's answers, think time, the per-turn summary, failures ending a conversation, files, bounds) and
once against a real tiny-model cluster."""

from __future__ import annotations

import argparse
import json
import threading
import time

import numpy as np
import pytest

from bench.loadtest import cli
from bench.loadtest.client import RequestResult
from bench.loadtest.conversations import (
    ConversationSettings,
    ConversationSpec,
    build_conversations,
    count_chat,
    draw_think_times,
)
from bench.loadtest.multiturn import ConversationRun, Outcome, summarize_conversations
from bench.loadtest.workloads import PromptBuilder, WorkloadSettings, load_tokenizer
from tests.bench.loadtest.scripted_server import Script, ScriptedServer

TOLERANCE_S = 0.05  # as in test_client: scheduler noise on a shared box, not client error
EARLY_S = 0.005


@pytest.fixture(scope="module")
def tokenizer(byte_tokenizer_dir):
    return load_tokenizer(str(byte_tokenizer_dir))


def run_cli(server, tmp_path, tokenizer_dir, *extra):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--base-url",
            server.base_url,
            "--tokenizer",
            str(tokenizer_dir),
            "--dataset-name",
            "multi-turn",
            "--disable-tqdm",
            "--random-input-len",
            "24",
            "--random-output-len",
            "5",
            "--result-dir",
            str(tmp_path / "out"),
            *extra,
        ]
    )
    return cli.run(args)


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]


def by_conversation(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in sorted(rows, key=lambda r: (r["conversation"], r["turn"])):
        out.setdefault(row["conversation"], []).append(row)
    return out


def turn_of(body: dict) -> int:
    return (len(body["messages"]) + 1) // 2


class Conversations:
    """Names the conversations the scripted server sees by the order their first user message arrived."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: dict[str, int] = {}

    def of(self, body: dict) -> int:
        with self.lock:
            return self.order.setdefault(body["messages"][0]["content"], len(self.order))


def test_every_turn_sends_the_history_with_the_servers_own_answers(tmp_path, byte_tokenizer_dir, tokenizer):
    def script(body, n):
        # each answer is unique (" a<n>" per token), and the usage counts the prompt as a real server would
        return Script(
            ttft_s=0.02,
            gap_s=0.005,
            token_text=f" a{n}",
            extra={"prompt_tokens": count_chat(tokenizer, body["messages"])},
        )

    with ScriptedServer(script) as server:
        summary = run_cli(server, tmp_path, byte_tokenizer_dir, "--num-conversations", "3", "--num-turns", "3")
        bodies = list(server.requests)
    assert len(bodies) == 9 and all(b["_path"] == "/v1/chat/completions" and b["stream"] for b in bodies)
    answers = {n: f" a{n}" * b["max_tokens"] for n, b in enumerate(bodies)}
    threads: dict[str, list[int]] = {}
    for n, body in enumerate(bodies):
        threads.setdefault(body["messages"][0]["content"], []).append(n)
    assert len(threads) == 3
    for ns in threads.values():
        assert [turn_of(bodies[n]) for n in ns] == [1, 2, 3]
        for prev, n in zip(ns, ns[1:]):  # turn k = turn k-1's messages + the answer the server gave + a new user turn
            msgs = bodies[n]["messages"]
            assert msgs[:-2] == bodies[prev]["messages"]
            assert msgs[-2] == {"role": "assistant", "content": answers[prev]}
            assert msgs[-1]["role"] == "user" and msgs[-1]["content"] not in [m["content"] for m in msgs[:-1]]
        for n in ns:  # each user message is exactly --random-input-len tokens on its own
            users = [m["content"] for m in bodies[n]["messages"] if m["role"] == "user"]
            assert all(len(tokenizer(u, add_special_tokens=False)["input_ids"]) == 24 for u in users)
            assert bodies[n]["max_tokens"] == 5
    run = summary["runs"][0]
    assert (run["requests"], run["completed"], run["failed"], run["input_tokens_mismatch"]) == (9, 9, 0, 0)
    rows = records(tmp_path)
    for turns in by_conversation(rows).values():
        assert [r["turn"] for r in turns] == [1, 2, 3]
        counts = [r["input_tokens"] for r in turns]
        assert counts == [r["expected_input_tokens"] for r in turns]
        assert counts[0] < counts[1] < counts[2]  # the history grows turn by turn
    sent = sorted(count_chat(tokenizer, b["messages"]) for b in bodies)
    assert sorted(r["input_tokens"] for r in rows) == sent
    m = run["multi_turn"]
    assert (m["conversations"], m["completed"], m["failed"], m["unfinished"]) == (3, 3, 0, 0)
    assert (m["turns_planned"], m["turns_sent"], m["turns_not_sent"]) == (9, 9, 0)
    assert [m["by_turn"][k]["completed"] for k in ("1", "2", "3")] == [3, 3, 3]
    assert m["cached_tokens"] is None  # this server reports none
    means = [m["by_turn"][k]["input_tokens_mean"] for k in ("1", "2", "3")]
    assert means[0] < means[1] < means[2]
    assert summary["benchmark"]["endpoint_type"] == "chat"


def test_the_summary_splits_ttft_by_turn_and_reports_cached_tokens(tmp_path, byte_tokenizer_dir):
    def script(body, n):
        turn = turn_of(body)
        return Script(
            ttft_s=0.3 if turn == 1 else 0.05,
            gap_s=0.005,
            cached_tokens=0 if turn == 1 else 16 * (turn - 1),
            extra={"prompt_tokens": 40 * turn},
        )

    with ScriptedServer(script) as server:
        summary = run_cli(server, tmp_path, byte_tokenizer_dir, "--num-conversations", "4", "--num-turns", "3")
    m = summary["runs"][0]["multi_turn"]
    rows = records(tmp_path)
    first = [r["ttft_s"] for r in rows if r["turn"] == 1]
    later = [r["ttft_s"] for r in rows if r["turn"] > 1]
    assert len(first) == 4 and len(later) == 8
    assert all(t >= 0.3 - EARLY_S for t in first) and all(t >= 0.05 - EARLY_S for t in later)
    # the summary is exactly the percentiles of the per-turn records
    assert m["ttft_ms_first_turn"]["median"] == pytest.approx(1000 * float(np.median(first)))
    assert m["ttft_ms_first_turn"]["p90"] == pytest.approx(1000 * float(np.percentile(first, 90)))
    assert m["ttft_ms_later_turns"]["median"] == pytest.approx(1000 * float(np.median(later)))
    assert m["ttft_ms_later_turns"]["p90"] == pytest.approx(1000 * float(np.percentile(later, 90)))
    assert m["ttft_ms_first_turn"]["median"] == pytest.approx(300, abs=1000 * TOLERANCE_S)
    assert m["ttft_ms_later_turns"]["median"] == pytest.approx(50, abs=1000 * TOLERANCE_S)
    assert m["later_over_first_ttft_p50"] == pytest.approx(
        m["ttft_ms_later_turns"]["median"] / m["ttft_ms_first_turn"]["median"]
    )
    assert m["by_turn"]["3"]["ttft_ms"]["count"] == 4
    cached = m["cached_tokens"]
    # per conversation: turns 1, 2, 3 report 0, 16, 32 cached of 40, 80, 120 prompt tokens
    assert cached["requests_reporting"] == 12
    assert (cached["cached_tokens"], cached["prompt_tokens"]) == (4 * 48, 4 * 240)
    assert cached["hit_rate"] == pytest.approx(48 / 240)
    assert cached["first_turn_hit_rate"] == 0.0 and cached["later_turns_hit_rate"] == pytest.approx(48 / 200)
    assert [m["by_turn"][k]["cached_tokens_mean"] for k in ("1", "2", "3")] == [0.0, 16.0, 32.0]
    assert [r["cached_tokens"] for r in sorted(rows, key=lambda r: r["turn"])][-1] == 32
    table = (tmp_path / "out" / "summary.csv").read_text().splitlines()
    assert "ttft_turn1_median_ms" in table[0] and len(table) == 2


def test_think_time_separates_an_answer_from_the_next_turn(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(ttft_s=0.02, gap_s=0.005)) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-conversations",
            "2",
            "--num-turns",
            "3",
            "--think-time-s",
            "0.3",
        )
    assert summary["runs"][0]["multi_turn"]["completed"] == 2
    for turns in by_conversation(records(tmp_path)).values():
        assert len(turns) == 3
        for prev, nxt in zip(turns, turns[1:]):
            answered = prev["sent_s"] + prev["e2el_s"]
            assert nxt["sent_s"] - answered >= 0.3 - EARLY_S  # bounded below; the box may add to it
            assert nxt["scheduled_s"] >= answered + 0.3 - EARLY_S


def test_think_times_fixed_or_exponential(tokenizer):
    rng = np.random.default_rng(0)
    assert draw_think_times(0.5, 3, "fixed", rng) == [0.5] * 3
    assert draw_think_times(0.0, 2, "exponential", rng) == [0.0, 0.0]
    gaps = np.array(draw_think_times(2.0, 20000, "exponential", rng))
    assert gaps.min() >= 0 and gaps.mean() == pytest.approx(2.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    builder = PromptBuilder(tokenizer, "chat", seed=0)
    settings = ConversationSettings(
        num_turns=4, num_turns_range_ratio=0.5, think_time_s=1.0, think_time_dist="exponential"
    )
    convs = build_conversations(settings, WorkloadSettings(random_input_len=12, random_output_len=3), builder, 40)
    turns = [c.turns for c in convs]
    assert min(turns) >= 2 and max(turns) <= 6 and len(set(turns)) > 1  # uniform within 4 ± 50%
    assert all(len(c.think_s) == c.turns - 1 and len(c.output_tokens) == c.turns for c in convs)
    assert all(n == 12 for c in convs for n in c.user_tokens)
    again = build_conversations(settings, WorkloadSettings(random_input_len=12, random_output_len=3), builder, 40)
    assert [c.think_s for c in again] == [c.think_s for c in convs]  # the same seed replays the same schedule


def test_a_failed_turn_ends_its_conversation(tmp_path, byte_tokenizer_dir):
    names = Conversations()

    def script(body, n):
        conv, turn = names.of(body), turn_of(body)
        if conv == 0 and turn == 2:
            return Script(status=500)
        if conv == 1 and turn == 1:
            return Script(ttft_s=0.02, gap_s=0.005, cut_after_chunks=2)
        return Script(ttft_s=0.02, gap_s=0.005)

    with ScriptedServer(script) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-conversations",
            "3",
            "--num-turns",
            "3",
            "--max-concurrency",
            "1",  # one conversation at a time: their order at the server is their dispatch order
        )
        seen = [(names.of(b), turn_of(b)) for b in server.requests]
    assert seen == [(0, 1), (0, 2), (1, 1), (2, 1), (2, 2), (2, 3)]  # nothing after a failed turn
    run = summary["runs"][0]
    assert (run["requests"], run["completed"], run["failures"]) == (6, 4, {"http_500": 1, "stream_cut": 1})
    m = run["multi_turn"]
    assert (m["completed"], m["failed"], m["unfinished"]) == (1, 2, 0)
    assert m["failed_by_reason"] == {"http_500": 1, "stream_cut": 1}
    assert (m["turns_planned"], m["turns_sent"], m["turns_not_sent"]) == (9, 6, 3)
    assert m["by_turn"]["2"] == m["by_turn"]["2"] | {"requests": 2, "completed": 1}
    rows = by_conversation(records(tmp_path))
    assert [r["error"] for r in rows[0]] == [None, "http_500"] and [r["error"] for r in rows[1]] == ["stream_cut"]


def test_a_sharegpt_file_supplies_the_user_turns(tmp_path, byte_tokenizer_dir):
    path = tmp_path / "chats.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "system", "value": "ignored"},
                        {"from": "human", "value": "first question"},
                        {"from": "gpt", "value": "seven!!"},
                        {"from": "human", "value": "and then?"},
                        {"from": "gpt", "value": "abc"},
                        {"from": "human", "value": "cut by --num-turns"},
                    ]
                },
                {"conversations": [{"from": "gpt", "value": "no human turn: skipped"}]},
                {"messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]},
            ]
        )
    )
    with ScriptedServer(lambda body, n: Script(ttft_s=0.01, gap_s=0.002)) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--dataset-path",
            str(path),
            "--num-conversations",
            "2",
            "--num-turns",
            "2",
            "--max-concurrency",
            "1",
        )
        sent = [
            ([m["content"] for m in b["messages"] if m["role"] == "user"], b["max_tokens"]) for b in server.requests
        ]
    assert summary["runs"][0]["multi_turn"]["completed"] == 2
    # byte tokenizer: a reply's token count is its byte count; "hello" has no reply: --random-output-len (5)
    want = {
        "first question": [(["first question"], 7), (["first question", "and then?"], 3)],
        "hello": [(["hello"], 5), (["hello", "again"], 5)],
    }
    got: dict[str, list] = {}
    for users, max_tokens in sent:
        got.setdefault(users[0], []).append((users, max_tokens))
    assert got == want


def test_at_most_max_concurrency_conversations_are_open(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(ttft_s=0.02, gap_s=0.005, tokens=2)) as server:
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-conversations",
            "5",
            "--num-turns",
            "2",
            "--think-time-s",
            "0.1",
            "--max-concurrency",
            "2",
        )
    m = summary["runs"][0]["multi_turn"]
    assert m["completed"] == 5 and summary["runs"][0]["closed_loop"]
    spans = [
        (turns[0]["sent_s"], turns[-1]["sent_s"] + turns[-1]["e2el_s"])
        for turns in by_conversation(records(tmp_path)).values()
    ]
    open_at = [sum(a <= t < b for a, b in spans) for t, _ in spans]  # open conversations when each one started
    assert max(open_at) == 2  # think times hold the slot: 5 conversations, 2 at a time


def test_the_duration_bound_cuts_conversations_that_are_thinking(tmp_path, byte_tokenizer_dir):
    with ScriptedServer(lambda body, n: Script(ttft_s=0.02, gap_s=0.005, tokens=2)) as server:
        started = time.perf_counter()
        summary = run_cli(
            server,
            tmp_path,
            byte_tokenizer_dir,
            "--num-conversations",
            "2",
            "--num-turns",
            "3",
            "--think-time-s",
            "30",
            "--duration",
            "1.0",
        )
        elapsed = time.perf_counter() - started
    run = summary["runs"][0]
    assert run["duration_s"] == pytest.approx(1.0, abs=0.2) and elapsed < 10
    assert (run["requests"], run["completed"], run["failures"]) == (2, 2, {})
    m = run["multi_turn"]
    assert (m["completed"], m["failed"], m["unfinished"], m["turns_not_sent"]) == (0, 0, 2, 4)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--endpoint-type", "completions"], "--endpoint-type chat"),
        (["--think-time-s", "-1"], "--think-time-s"),
        (["--num-turns", "0"], "--num-turns"),
        (["--num-conversations", "0"], "--num-conversations or --duration"),
    ],
)
def test_bad_multi_turn_options_are_refused_before_sending(tmp_path, byte_tokenizer_dir, extra, message):
    class Gone:
        base_url = "http://127.0.0.1:9"  # nothing listens: nothing may be sent

    with pytest.raises(ValueError, match=message):
        run_cli(Gone, tmp_path, byte_tokenizer_dir, *extra)


def _turn(conv: int, turn: int, ttft: float | None, prompt: int = 100, cached: int | None = None, error=None):
    return RequestResult(
        index=0,
        success=error is None,
        error=error,
        sent_s=0.0,
        ttft_s=ttft,
        conversation=conv,
        turn=turn,
        input_tokens=prompt,
        cached_tokens=cached,
    )


def test_summary_by_hand():
    spec = ConversationSpec(0, ["a", "b", "c"], [1, 1, 1], [4, 4, 4], [0.0, 0.0])
    runs = [
        ConversationRun(
            0,
            spec,
            results=[_turn(0, 1, 0.1, 50, 0), _turn(0, 2, 0.01, 100, 48), _turn(0, 3, 0.02, 150, 96)],
            outcome=Outcome.COMPLETED,
        ),
        ConversationRun(
            1,
            spec,
            results=[_turn(1, 1, 0.2, 50, 0), _turn(1, 2, None, error="timeout")],
            outcome=Outcome.FAILED,
            failure="timeout",
        ),
        ConversationRun(2, spec, results=[_turn(2, 1, 0.3, 50, 0), _turn(2, 2, 0.04, 100, 48)]),
        ConversationRun(-1, spec, warmup=True, results=[_turn(-1, 1, 9.0)], outcome=Outcome.COMPLETED),
    ]
    m = summarize_conversations(runs)
    assert (m["conversations"], m["completed"], m["failed"], m["unfinished"]) == (3, 1, 1, 1)
    assert m["failed_by_reason"] == {"timeout": 1}
    assert (m["turns_planned"], m["turns_sent"], m["turns_not_sent"]) == (9, 7, 2)
    assert m["ttft_ms_first_turn"]["median"] == pytest.approx(200.0)  # warm-up's 9 s left out
    assert m["ttft_ms_first_turn"]["p90"] == pytest.approx(280.0)  # 200 + 0.8 * (300 - 200)
    assert m["ttft_ms_later_turns"]["median"] == pytest.approx(20.0)  # 10, 20, 40
    assert m["ttft_ms_later_turns"]["p90"] == pytest.approx(36.0)  # 20 + 0.8 * (40 - 20)
    assert m["later_over_first_ttft_p50"] == pytest.approx(0.1)
    assert (m["by_turn"]["2"]["requests"], m["by_turn"]["2"]["completed"]) == (3, 2)
    assert m["by_turn"]["3"]["input_tokens_mean"] == 150.0
    cached = m["cached_tokens"]
    assert (cached["cached_tokens"], cached["prompt_tokens"]) == (192, 500)
    assert cached["later_turns_hit_rate"] == pytest.approx(192 / 350) and cached["first_turn_hit_rate"] == 0.0


@pytest.mark.timeout(180)
def test_two_conversations_of_three_turns_on_a_real_cluster(tiny_llama_path, tmp_path):
    from cluster.run.launch import start_serving
    from tests.helpers.cluster import tiny_cluster_config, wait_all_kv_free

    config = tiny_cluster_config(tiny_llama_path)
    handle = start_serving(config, in_process=True)
    try:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(
            [
                "--base-url",
                handle.base_url,
                "--model",
                config.served_model_name,
                "--tokenizer",
                str(tiny_llama_path),
                "--dataset-name",
                "multi-turn",
                "--num-conversations",
                "2",
                "--num-turns",
                "3",
                "--random-input-len",
                "20",
                "--random-output-len",
                "6",
                "--ignore-eos",
                "--think-time-s",
                "0.05",
                "--disable-tqdm",
                "--result-dir",
                str(tmp_path / "out"),
            ]
        )
        summary = cli.run(args)
        wait_all_kv_free(handle.base_url, api_key=handle.config.router.api_key)
        assert not handle.router.flows
    finally:
        handle.stop()
    run = summary["runs"][0]
    assert (run["requests"], run["completed"], run["failed"]) == (6, 6, 0)
    assert run["total_output_tokens"] == 6 * 6
    assert run["input_tokens_mismatch"] == 0  # the server counted each templated history as we did
    m = run["multi_turn"]
    assert (m["completed"], m["turns_sent"]) == (2, 6)
    for turns in by_conversation(records(tmp_path)).values():
        counts = [r["input_tokens"] for r in turns]
        assert len(counts) == 3 and counts[0] < counts[1] < counts[2]
        # each turn adds the previous answer and a new 20-token user message (with their template tokens)
        assert all(b - a > 20 for a, b in zip(counts, counts[1:]))
