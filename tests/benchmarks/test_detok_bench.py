"""The detokenizer bench on the tiny model's tokenizer, and the incremental detokenizer doing constant work per token."""

from __future__ import annotations

import json

from benchmarks import detok_bench
from cli.main import main
from engine.detokenizer import IncrementalDetokenizer
from engine.tiny_model import build_byte_tokenizer
from tests.engine.test_detokenizer import CountingTokenizer


def test_measure_shape_and_identical_text():
    tokenizer = build_byte_tokenizer()
    out = detok_bench.measure(tokenizer, [60, 120, 240], repeats=1)
    assert out["lengths"] == [60, 120, 240] and out["identical_text"] is True
    for method in ("full_redecode", "incremental"):
        assert set(out["us_per_token"][method]) == {"60", "120", "240"}
        assert all(v > 0 for v in out["us_per_token"][method].values())
        assert out["growth"][method] > 0
    assert set(out["speedup"]) == {"60", "120", "240"}
    # both methods give the text tokenizer.decode gives (measure raises otherwise); check it here too
    ids = detok_bench.stream_ids(tokenizer, 240)
    texts = [
        detok_bench._stream(cls(tokenizer, list(detok_bench.STOP)), ids)[1]
        for cls in (detok_bench.FullRedecodeBaseline, IncrementalDetokenizer)
    ]
    assert texts[0] == texts[1] == tokenizer.decode(ids, skip_special_tokens=True)
    assert any(ord(c) > 127 for c in texts[0])  # characters over several tokens were in the stream


def test_cli_prints_the_json(capsys):
    assert main(["bench", "detok", "--tiny", "--lengths", "40,80", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokenizer"] == "tiny byte-level" and out["lengths"] == [40, 80]
    assert set(out["us_per_token"]) == {"full_redecode", "incremental"}


def test_detokenizer_work_per_token_is_constant():
    tokenizer = CountingTokenizer(build_byte_tokenizer())
    ids = detok_bench.stream_ids(tokenizer, 800)
    detokenizer = IncrementalDetokenizer(tokenizer, ["\x00never"])
    per_token, text = [], ""
    for i, token_id in enumerate(ids):
        before = sum(tokenizer.lengths)
        text += detokenizer.add([token_id], final=i == len(ids) - 1)
        per_token.append(sum(tokenizer.lengths) - before)
    assert text == detokenizer.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert not detokenizer.stopped
    assert max(per_token) <= 32  # ids decoded per new token: the baseline decodes all of them (up to 800)
    assert sum(per_token[-200:]) <= 1.5 * sum(per_token[:200]) + 200
