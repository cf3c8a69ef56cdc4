"""The engine streams text: every output's ``text_delta``, joined, is exactly the request's text.

Workers send these deltas and the router only relays them, so they must equal ``tokenizer.decode(output ids,
skip_special_tokens=True)`` (cut at a stop string) for every tokenizer we support, and across the prefill -> decode
hand-off the prefill worker's first delta plus the decode worker's deltas must be the single-engine text.
"""

from __future__ import annotations

import pytest

from engine.kv_connector import KVBlocksReady
from engine.request import FinishReason, RequestStatus, SamplingParams
from tests.engine.test_detokenizer import _byte_fallback_bpe, _metaspace_unigram
from tests.helpers.engine import random_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, **GREEDY, **kwargs})


def stream_all(engine, prompts, make_params) -> list[dict]:
    """Run requests together through step(); per request: its deltas, token ids, final output text and reason."""
    runs = {}
    for i, prompt in enumerate(prompts):
        rid = engine.add_request(prompt, make_params(i))
        runs[rid] = {"deltas": [], "ids": [], "text": None, "reason": None}
    for _ in range(10_000):
        if not engine.has_unfinished():
            break
        for output in engine.step():
            run = runs[output.request_id]
            assert output.error is None and run["reason"] is None
            run["deltas"].append(output.text_delta)
            run["ids"] += output.new_token_ids
            if output.finished:
                run["text"], run["reason"] = output.text, output.finish_reason
    return list(runs.values())


def _spanning_stop(tokenizer, ids: list[int], text: str) -> str:
    """A stop string across a token boundary (2 to 4 characters, no U+FFFD), late in ``text`` when it can be."""
    boundaries = list(range(len(ids) // 2, len(ids))) + list(range(1, len(ids) // 2))
    for before, after in ((2, 2), (1, 2), (2, 1), (1, 1)):
        for m in boundaries:
            head = tokenizer.decode(ids[:m], skip_special_tokens=True)
            stop = text[max(0, len(head) - before) : len(head) + after]
            if len(stop) == before + after and "\ufffd" not in stop and text.startswith(head):
                return stop
    raise AssertionError(f"no stop string candidate in {text!r}")


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_qwen2_path"])
def test_deltas_join_to_the_decoded_text(model, request, make_engine):
    engine = make_engine(request.getfixturevalue(model))
    tokenizer = engine.tokenizer
    prompts = random_prompts(6, 4, 40, seed=31)
    runs = stream_all(
        engine, prompts, lambda i: _params(max_tokens=40 + 7 * i, temperature=0.0 if i % 2 else 0.9, seed=i)
    )
    held = 0
    for run in runs:
        expected = tokenizer.decode(run["ids"], skip_special_tokens=True)
        assert "".join(run["deltas"]) == expected == run["text"]
        assert sum(1 for d in run["deltas"] if d) > 5  # streamed as it went, not all at the finish
        held += sum(1 for d in run["deltas"][:-1] if not d)  # a token whose text was held (half a character)
    assert held > 0 and any(ord(c) > 127 for run in runs for c in run["text"])
    # generate() is unchanged: the same text as before, and the same as the deltas
    results = engine.generate(
        prompts,
        [_params(max_tokens=40 + 7 * i, temperature=0.0 if i % 2 else 0.9, seed=i) for i in range(len(prompts))],
    )
    assert [r.text for r in results] == [r["text"] for r in runs]
    assert [r.token_ids for r in results] == [r["ids"] for r in runs]


@pytest.mark.parametrize("model", ["tiny_llama_path", "tiny_qwen2_path"])
def test_a_stop_string_across_deltas_cuts_the_streamed_text(model, request, make_engine):
    engine = make_engine(request.getfixturevalue(model))
    tokenizer = engine.tokenizer
    prompts = random_prompts(3, 8, 30, seed=32)
    free = stream_all(engine, prompts, lambda i: _params(max_tokens=64))
    stops = [_spanning_stop(tokenizer, run["ids"], run["text"]) for run in free]
    runs = stream_all(engine, prompts, lambda i: _params(max_tokens=64, stop=[stops[i], "\x00never"]))
    for run, plain, stop in zip(runs, free, stops):
        expected = plain["text"][: plain["text"].find(stop)]
        assert run["reason"] == FinishReason.STOP
        assert "".join(run["deltas"]) == expected == run["text"]
        assert len(run["ids"]) < len(plain["ids"])  # generation stopped there, too
        emitted = ""
        for delta in run["deltas"]:  # what was sent never went past the cut
            emitted += delta
            assert expected.startswith(emitted)


@pytest.mark.parametrize("kind", ["metaspace", "byte_fallback"])
def test_deltas_with_sentencepiece_tokenizers(kind, tiny_llama_path, make_engine):
    """The tiny model's ids decoded with SentencePiece-style tokenizers (first-token space rule, byte fallback)."""
    engine = make_engine(tiny_llama_path)
    engine.tokenizer = tokenizer = (_metaspace_unigram if kind == "metaspace" else _byte_fallback_bpe)(cleanup=True)
    prompts = random_prompts(4, 4, 30, seed=33)
    runs = stream_all(engine, prompts, lambda i: _params(max_tokens=50))
    for run in runs:
        assert "".join(run["deltas"]) == tokenizer.decode(run["ids"], skip_special_tokens=True) == run["text"]
        assert sum(1 for d in run["deltas"] if d) > 5


def test_deltas_with_the_default_model(smollm2_path, make_engine):
    engine = make_engine(smollm2_path, kv_blocks=64)
    tokenizer = engine.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write one sentence about Paris, café and crème brûlée."}],
        add_generation_prompt=True,
        tokenize=True,
    )
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    [run] = stream_all(engine, [prompt], lambda i: _params(max_tokens=32, ignore_eos=False))
    assert "".join(run["deltas"]) == tokenizer.decode(run["ids"], skip_special_tokens=True) == run["text"]
    assert len(run["text"]) > 20 and sum(1 for d in run["deltas"] if d) > 5
    stop = _spanning_stop(tokenizer, run["ids"], run["text"])
    [cut] = stream_all(engine, [prompt], lambda i: _params(max_tokens=32, ignore_eos=False, stop=[stop]))
    assert cut["reason"] == FinishReason.STOP
    assert "".join(cut["deltas"]) == run["text"][: run["text"].find(stop)] == cut["text"]


# ---- the prefill -> decode hand-off -------------------------------------------------------------------------------


def _prefilled(prefill, decode, prompt: list[int], params: SamplingParams, rid: str, write_kv: bool):
    """Reserve on decode, prefill there with a KV sink (writing each reported block range into the reserved blocks,
    or dropping it), release; returns prefill's first output."""
    dst = decode.kv_importer.reserve(prompt, params, rid)

    def sink(ready: KVBlocksReady) -> None:
        if write_kv:
            decode.kv_importer.write(rid, ready.layer, dst[ready.first_block : ready.end_block], ready.k, ready.v)

    prefill.add_request(
        prompt, SamplingParams(max_tokens=1, **GREEDY, stop=list(params.stop)), rid, prefill_only=True, kv_sink=sink
    )
    [first] = [o for _ in range(10) for o in prefill.step()]
    assert first.finished and prefill.requests[rid].status == RequestStatus.PREFILLED
    prefill.release(rid)
    return first


def _client_text(first, decode) -> tuple[str, list[int], str]:
    """Prefill's first delta, then every delta the decode engine's steps make (its admission's included)."""
    deltas, ids, reason = [first.text_delta], list(first.new_token_ids), None
    while decode.has_unfinished():
        for output in decode.step():
            deltas.append(output.text_delta)
            ids += output.new_token_ids
            reason = output.finish_reason or reason
    return "".join(deltas), ids, reason.value


def handoff_text(prefill, decode, prompt: list[int], params: SamplingParams, rid: str) -> tuple[str, list[int], str]:
    """What the client gets in disaggregated serving: prefill's first delta, then decode's deltas."""
    first = _prefilled(prefill, decode, prompt, params, rid, write_kv=True)
    decode.kv_importer.tokens_in(rid, [first.new_token_ids[0]])
    assert decode.kv_importer.kv_done(rid)
    return _client_text(first, decode)


def resumed_text(prefill, decode, prompt: list[int], params: SamplingParams, rid: str) -> tuple[str, list[int], str]:
    """The decode worker's recompute: the KV never came, so the prompt and the first token are prefilled there."""
    first = _prefilled(prefill, decode, prompt, params, rid, write_kv=False)
    assert decode.kv_importer.kv_failed(rid, recompute=True)
    decode.kv_importer.tokens_in(rid, [first.new_token_ids[0]])
    return _client_text(first, decode)


@pytest.mark.parametrize("kind", ["byte_level", "metaspace", "byte_fallback"])
def test_handoff_text_is_the_single_engine_text(kind, tiny_llama_path, make_engine):
    single, prefill, decode = (make_engine(tiny_llama_path) for _ in range(3))
    if kind != "byte_level":  # the first token's leading space is where SentencePiece decoders differ
        tokenizer = (_metaspace_unigram if kind == "metaspace" else _byte_fallback_bpe)(cleanup=False)
        for engine in (single, prefill, decode):
            engine.tokenizer = tokenizer
    tokenizer = single.tokenizer
    cases = []
    for prompt in random_prompts(4, 8, 40, seed=34):
        [free] = single.generate([prompt], _params(max_tokens=30))
        stop = _spanning_stop(tokenizer, free.token_ids, free.text)
        first_text = tokenizer.decode(free.token_ids[:1], skip_special_tokens=True).strip()
        cases += [
            (prompt, _params(max_tokens=30)),
            (prompt, _params(max_tokens=1)),
            (prompt, _params(max_tokens=30, stop=[stop])),
        ]
        if first_text and "\ufffd" not in first_text:  # a stop string inside the first token's text
            cases.append((prompt, _params(max_tokens=30, stop=[first_text[-1]])))
    stopped_at_first = 0
    for n, (prompt, params) in enumerate(cases):
        [expected] = single.generate([prompt], params)
        for run in (handoff_text, resumed_text):
            text, ids, reason = run(prefill, decode, prompt, _copy(params), f"{run.__name__}-{n}")
            assert (text, ids, reason) == (expected.text, expected.token_ids, expected.finish_reason), (run, params)
        assert expected.finish_reason == ("stop" if params.stop else "length")
        stopped_at_first += bool(params.stop) and len(expected.token_ids) == 1
    assert stopped_at_first > 0


def _copy(params: SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
    )
