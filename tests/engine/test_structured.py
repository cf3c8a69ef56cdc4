"""engine/structured.py: grammars as token masks, on the tiny byte tokenizer with random logits.

A random "model" is the hardest client a grammar can have: every token it is allowed it may pick. Texts sampled
under the mask must still parse and validate, EOS must be reachable only on a complete match, and padding ids of a
model vocabulary wider than the tokenizer's must never be drawn.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.request import GuidedDecoding
from engine.structured import (
    GrammarError,
    GrammarState,
    allocate_bitmask,
    apply_bitmask,
    compile_grammar,
)
from engine.tiny_model import build_byte_tokenizer

PADDED_VOCAB = 300  # the tokenizer has 259 ids: 41 padding ids (not a multiple of 32 either)
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"type": "string", "maxLength": 6},
        "note": {"type": "string"},
        "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["ok", "color", "n", "tag", "note", "items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _bit(bitmask: torch.Tensor, row: int, token_id: int) -> bool:
    return bool((int(bitmask[row, token_id // 32]) >> (token_id % 32)) & 1)


def _sample_constrained(tokenizer, guided: GuidedDecoding, seeds: list[int], max_steps: int = 3000) -> list[str]:
    """Decode one text per seed in ONE batch: row 0 is an unconstrained request that must stay untouched, rows 1..
    are the constrained ones (so the bitmask row -> logits row mapping is exercised). Stops on EOS."""
    compiled = compile_grammar(tokenizer, PADDED_VOCAB, guided)
    states = [GrammarState(compiled) for _ in seeds]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    tokens: list[list[int]] = [[] for _ in seeds]
    bitmask = allocate_bitmask(len(seeds), PADDED_VOCAB)
    for _ in range(max_steps):
        live = [i for i, state in enumerate(states) if not state.is_terminated()]
        if not live:
            break
        logits = torch.randn(1 + len(live), PADDED_VOCAB, generator=generators[live[0]]) * 4
        free_row = logits[0].clone()
        for slot, i in enumerate(live):
            states[i].fill_bitmask(bitmask, slot)
        apply_bitmask(logits, bitmask, [1 + slot for slot in range(len(live))])
        assert torch.equal(logits[0], free_row), "an unconstrained row was masked"
        for slot, i in enumerate(live):
            row = logits[1 + slot]
            assert torch.isinf(row[259:]).all(), "padding ids beyond the tokenizer must be masked"
            token = int(torch.multinomial(torch.softmax(row, -1), 1, generator=generators[i]))
            assert states[i].accept(token), f"a token the mask allowed was refused: {token}"
            tokens[i].append(token)
    assert all(state.is_terminated() for state in states), "a constrained text never finished"
    eos = tokenizer.eos_token_id
    for ids in tokens:
        assert ids[-1] == eos and eos not in ids[:-1]
    return [tokenizer.decode(ids[:-1]) for ids in tokens]


def test_json_schema_texts_parse_and_validate(tokenizer):
    texts = _sample_constrained(tokenizer, GuidedDecoding("json_schema", json.dumps(SCHEMA)), seeds=list(range(6)))
    values = [json.loads(text) for text in texts]
    for value in values:
        jsonschema.validate(value, SCHEMA)
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1, "random logits should give different values"


@pytest.mark.parametrize("bounds", [{"maxLength": 5}, {"minLength": 1}, {}])
def test_strings_never_hold_raw_control_characters(tokenizer, bounds):
    """JSON forbids raw U+0000-U+001F in strings (json.loads and pydantic refuse them); xgrammar 0.2 lets them into
    length-bounded strings unless engine.structured rewrites the class."""
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}, "required": ["s"]}
    compiled = compile_grammar(tokenizer, PADDED_VOCAB, GuidedDecoding("json_schema", json.dumps(schema)))
    state = GrammarState(compiled)
    for token in tokenizer.encode('{"s": "a'):
        assert state.accept(token)
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    state.fill_bitmask(bitmask, 0)
    for char in "\t\x01\x1f\n":
        assert not _bit(bitmask, 0, tokenizer.encode(char)[0]), repr(char)
    assert _bit(bitmask, 0, tokenizer.encode("b")[0]) and _bit(bitmask, 0, tokenizer.encode("\x7f")[0])


def test_json_object_is_an_object(tokenizer):
    texts = _sample_constrained(tokenizer, GuidedDecoding("json_object"), seeds=[1, 2, 3])
    assert all(isinstance(json.loads(text), dict) for text in texts)


def test_regex_and_ebnf(tokenizer):
    pattern = r"[a-c]{2,4}-\d{3}(!|\?)"
    for text in _sample_constrained(tokenizer, GuidedDecoding("regex", pattern), seeds=[4, 5, 6]):
        assert re.fullmatch(pattern, text), text
    grammar = 'root ::= "yes" | "no" | "maybe " num\nnum ::= [1-9] [0-9]?'
    texts = _sample_constrained(tokenizer, GuidedDecoding("ebnf", grammar), seeds=[7, 8, 9, 10])
    assert all(re.fullmatch(r"yes|no|maybe [1-9][0-9]?", t) for t in texts), texts


def test_eos_only_when_complete(tokenizer):
    compiled = compile_grammar(tokenizer, PADDED_VOCAB, GuidedDecoding("regex", r"ab+"))
    state = GrammarState(compiled)
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    eos = tokenizer.eos_token_id
    a, b = tokenizer.encode("ab")

    state.fill_bitmask(bitmask, 0)
    assert not state.allows_eos() and not _bit(bitmask, 0, eos) and _bit(bitmask, 0, a) and not _bit(bitmask, 0, b)
    assert not state.accept(eos) and not state.accept(b), "tokens outside the grammar are refused"
    assert state.accept(a) and not state.allows_eos()  # "a" is not a match yet
    assert state.accept(b) and state.allows_eos()  # "ab" is
    state.fill_bitmask(bitmask, 0)
    assert _bit(bitmask, 0, eos) and _bit(bitmask, 0, b) and not _bit(bitmask, 0, a)
    for special in tokenizer.all_special_ids:
        if special != eos:
            assert not _bit(bitmask, 0, special), "special tokens other than the stop ones stay masked"
    assert not state.is_terminated()
    assert state.accept(eos) and state.is_terminated() and not state.allows_eos()
    assert not state.accept(b), "nothing is accepted after the end"
    state.fill_bitmask(bitmask, 0)  # a caller that goes on (ignore_eos) gets the stop tokens only, not an exception
    assert [t for t in range(PADDED_VOCAB) if _bit(bitmask, 0, t)] == [eos]


def test_stop_token_ids_decide_which_eos(tokenizer):
    """The engine's EOS set (generation_config may list several) is what the complete grammar allows."""
    other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    compiled = compile_grammar(
        tokenizer, PADDED_VOCAB, GuidedDecoding("regex", "x"), stop_token_ids=[other, tokenizer.eos_token_id]
    )
    state = GrammarState(compiled)
    assert state.accept(tokenizer.encode("x")[0])
    bitmask = allocate_bitmask(1, PADDED_VOCAB)
    state.fill_bitmask(bitmask, 0)
    assert _bit(bitmask, 0, other) and _bit(bitmask, 0, tokenizer.eos_token_id)
    assert state.accept(other) and state.is_terminated()
    state.fill_bitmask(bitmask, 0)
    assert [t for t in range(PADDED_VOCAB) if _bit(bitmask, 0, t)] == sorted([other, tokenizer.eos_token_id])
    # the same after the end when a stop id is a word's sign bit (id % 32 == 31)
    last_bit = compile_grammar(tokenizer, PADDED_VOCAB, GuidedDecoding("regex", "x"), stop_token_ids=[287])
    state = GrammarState(last_bit)
    assert state.accept(tokenizer.encode("x")[0]) and state.accept(287) and state.is_terminated()
    state.fill_bitmask(bitmask, 0)
    assert [t for t in range(PADDED_VOCAB) if _bit(bitmask, 0, t)] == [287]


def test_replay_reaches_the_same_state(tokenizer):
    """A decode worker accepting the tokens the prefill side sampled gets the same mask: the hand-off's contract."""
    compiled = compile_grammar(tokenizer, PADDED_VOCAB, GuidedDecoding("json_schema", json.dumps(SCHEMA)))
    first, replayed = GrammarState(compiled), GrammarState(compiled)
    prefix = tokenizer.encode('{"ok": false, "color": "gr')
    for token in prefix:
        assert first.accept(token)
    for token in prefix:
        assert replayed.accept(token)
    masks = allocate_bitmask(2, PADDED_VOCAB)
    first.fill_bitmask(masks, 0)
    replayed.fill_bitmask(masks, 1)
    assert torch.equal(masks[0], masks[1])
    allowed = [t for t in range(PADDED_VOCAB) if _bit(masks, 0, t)]
    assert tokenizer.decode(allowed) == "e", "only 'green' continues 'gr'"


def test_compiled_grammars_are_cached_per_tokenizer_and_width(tokenizer):
    guided = GuidedDecoding("json_schema", json.dumps(SCHEMA))
    one = compile_grammar(tokenizer, PADDED_VOCAB, guided)
    assert compile_grammar(tokenizer, PADDED_VOCAB, GuidedDecoding("json_schema", json.dumps(SCHEMA))) is one
    narrow = compile_grammar(tokenizer, 259, guided)
    assert narrow is not one and narrow.vocab_size == 259
    assert compile_grammar(build_byte_tokenizer(), PADDED_VOCAB, guided) is not one


def test_apply_bitmask_masks_logits_wider_than_the_bitmask(tokenizer):
    compiled = compile_grammar(tokenizer, 259, GuidedDecoding("regex", "z"))
    bitmask = allocate_bitmask(1, 259)
    GrammarState(compiled).fill_bitmask(bitmask, 0)
    logits = torch.zeros(2, 320)
    apply_bitmask(logits, bitmask, [1])
    assert torch.equal(logits[0], torch.zeros(320))
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == tokenizer.encode("z")
    apply_bitmask(logits, bitmask, [])  # no constrained rows: nothing to do


@pytest.mark.parametrize(
    ("guided", "needle"),
    [
        (GuidedDecoding("json_schema", "{not json"), "not valid JSON"),
        (GuidedDecoding("json_schema", "[1, 2]"), "must be a JSON object"),
        (GuidedDecoding("json_schema", '{"type": "wat"}'), 'Unsupported type "wat"'),
        (GuidedDecoding("json_schema", '{"properties": {"a": {"$ref": "#/nope"}}}'), "nope"),
        (GuidedDecoding("regex", "a(b"), "parenthesis is not closed"),
        (GuidedDecoding("regex", "[z-a]"), "lower bound is larger"),
        (GuidedDecoding("ebnf", "root ::= foo"), 'Rule "foo" is not defined'),
        (GuidedDecoding("xml", "<a/>"), "guided kind must be"),  # type: ignore[arg-type]
    ],
)
def test_bad_specs_raise_grammar_error(tokenizer, guided, needle):
    with pytest.raises(GrammarError) as info:
        compile_grammar(tokenizer, PADDED_VOCAB, guided)
    message = str(info.value)
    assert isinstance(info.value, ValueError)  # the engine turns it into the request's invalid_request
    assert needle in message and message.startswith(guided.kind + ": ") or "guided kind" in message, message
    assert ".cc:" not in message, "xgrammar's source location is noise to a client"
