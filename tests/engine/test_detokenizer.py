"""Incremental detokenization: the streamed text is exactly ``tokenizer.decode(ids, skip_special_tokens=True)`` for
every kind of tokenizer, stop strings cut it exactly, and the work per token does not grow with the output."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from engine.detokenizer import IncrementalDetokenizer, tokenizer_info
from engine.request import SamplingParams

CORPUS = [
    "Hello world, it's a test. Don't stop! Isn't it? We've done it, they're here, I'm fine.",
    "The café served crème brûlée ; naïve façade, déjà vu, Ærø, Łódź, İstanbul, São Paulo.",
    "日本語のテキストと中文文本，还有한국어 텍스트。 😀 🎉 👍🏽 emoji mix",
    "Numbers 12345 and symbols #@$%^&*() [brackets] {braces} <angle> 'quotes' \"double\"",
    "Ich weiß nicht , oder ? Ça va ! ¿Qué tal ? I can n't , you 're right , he 's gone .",
    "  spaces   and\ttabs\nnew lines ' quoted ' and  . dots , commas ! marks ?",
]


# ---- tokenizers of every kind we support, built in-process -----------------------------------------------------------


def _metaspace_unigram(cleanup: bool):
    """SentencePiece style: Unigram, "▁" for spaces, the decoder strips the first token's leading space."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.Unigram())
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    core.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=220, special_tokens=["<unk>", "<s>", "</s>"], unk_token="<unk>", show_progress=False
    )
    core.train_from_iterator(CORPUS * 20, trainer)
    core.add_tokens([AddedToken("<tool>", special=False, normalized=False)])  # an added token that is not special
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=cleanup,
    )


def _byte_fallback_bpe(cleanup: bool):
    """Llama-2/Mistral style: BPE with <0xNN> byte tokens, decoder Replace("▁") + ByteFallback + Fuse + Strip."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60, show_progress=False
    )
    trained.train_from_iterator(CORPUS * 20, trainer)
    vocab = trained.get_vocab(with_added_tokens=False)
    saved = json.loads(trained.to_str())["model"]["merges"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in saved]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    core.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ["<unk>", "<s>", "</s>"]])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=cleanup,
        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=cleanup,
    )


def _wordpiece_cleanup():
    """BERT style: WordPiece, "##" continuations, the decoder's own clean-up plus transformers' clean-up."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=False)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    core.train_from_iterator(
        CORPUS * 20,
        trainers.WordPieceTrainer(vocab_size=300, show_progress=False, special_tokens=["[UNK]", "[CLS]", "[SEP]"]),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        clean_up_tokenization_spaces=True,
    )


_CACHE: dict[str, object] = {}


def get_tokenizer(name: str, request: pytest.FixtureRequest):
    if name not in _CACHE:
        from transformers import AutoTokenizer

        from engine.tiny_model import build_byte_tokenizer

        builders = {
            "tiny_llama": lambda: AutoTokenizer.from_pretrained(request.getfixturevalue("tiny_llama_path")),
            "tiny_qwen2": lambda: AutoTokenizer.from_pretrained(request.getfixturevalue("tiny_qwen2_path")),
            "smollm2": lambda: AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path")),
            "metaspace": lambda: _metaspace_unigram(cleanup=False),
            "metaspace_cleanup": lambda: _metaspace_unigram(cleanup=True),
            "byte_fallback": lambda: _byte_fallback_bpe(cleanup=False),
            "byte_fallback_cleanup": lambda: _byte_fallback_bpe(cleanup=True),
            "wordpiece_cleanup": _wordpiece_cleanup,
            "bpe_cleanup_flag": lambda: _with_cleanup_flag(build_byte_tokenizer()),
        }
        _CACHE[name] = builders[name]()
    return _CACHE[name]


def _with_cleanup_flag(tokenizer):
    tokenizer.clean_up_tokenization_spaces = True  # transformers ignores it for BPE: so must we
    return tokenizer


ALL = [
    "tiny_llama",
    "tiny_qwen2",
    "smollm2",
    "metaspace",
    "metaspace_cleanup",
    "byte_fallback",
    "byte_fallback_cleanup",
    "wordpiece_cleanup",
    "bpe_cleanup_flag",
]


# ---- sequences and streaming -----------------------------------------------------------------------------------------


def _special_ids(tokenizer) -> list[int]:
    return sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)


def text_ids(tokenizer, rng: random.Random, max_words: int = 10) -> list[int]:
    sentence = rng.choice(CORPUS).split(" ")
    start = rng.randrange(len(sentence))
    return list(tokenizer.encode(" ".join(sentence[start : start + max_words]), add_special_tokens=False))


def random_sequence(tokenizer, rng: random.Random) -> list[int]:
    """Encoded text (multi-byte characters, clean-up patterns) with special tokens and random ids mixed in, or
    random ids outright (byte garbage, invalid UTF-8), a few beyond the vocabulary."""
    vocab, special = len(tokenizer), _special_ids(tokenizer)
    if rng.random() < 0.3:
        return [rng.randrange(vocab + 2) for _ in range(rng.randint(1, 30))]
    ids = text_ids(tokenizer, rng) + text_ids(tokenizer, rng)
    out = []
    for token_id in ids:
        roll = rng.random()
        if roll < 0.08 and special:
            out.append(rng.choice(special))
        elif roll < 0.12:
            token_id = rng.randrange(vocab)
        out.append(token_id)
    return out


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], rng: random.Random | None, expected: str) -> str:
    """Feed ids one at a time (rng None) or in random chunks; every prefix emitted must be a prefix of ``expected``."""
    emitted = ""
    i = 0
    while i < len(ids):
        size = 1 if rng is None else rng.choice([1, 1, 2, 3, 5, 8])
        chunk, i = ids[i : i + size], i + size
        emitted += detokenizer.add(chunk, final=rng is not None and i >= len(ids) and rng.random() < 0.5)
        assert expected.startswith(emitted), (ids, emitted, expected)
        if detokenizer.stopped:
            return emitted
    emitted += detokenizer.add([], final=True)
    return emitted


@pytest.mark.parametrize("name", ALL)
def test_streamed_text_equals_full_decode(name, request):
    tokenizer = get_tokenizer(name, request)
    rng = random.Random(f"exact-{name}")
    multibyte = cleaned = 0
    for _ in range(150):
        ids = random_sequence(tokenizer, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        for chunks in (None, rng):
            detokenizer = IncrementalDetokenizer(tokenizer)
            assert stream(detokenizer, ids, chunks, expected) == expected
            assert detokenizer.text == expected and not detokenizer.stopped
        multibyte += any(ord(c) > 127 for c in expected)
        cleaned += expected != tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert multibyte > 20  # the hard cases were there: characters over several tokens, U+FFFD, first-space rules
    if tokenizer_info(tokenizer).cleanup:
        assert cleaned > 10  # and clean-up changed the text, across deltas


@pytest.mark.parametrize("name", ["tiny_llama", "smollm2", "metaspace_cleanup", "byte_fallback", "wordpiece_cleanup"])
def test_stop_strings_spanning_deltas_cut_exactly(name, request):
    tokenizer = get_tokenizer(name, request)
    rng = random.Random(f"stop-{name}")
    spanning = 0
    for _ in range(60):
        ids = text_ids(tokenizer, rng, 8) + text_ids(tokenizer, rng, 8)
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if len(full) < 8:
            continue
        # where the deltas of a plain stream end: a stop string across one of these spans two deltas
        plain, ends, length = IncrementalDetokenizer(tokenizer), set(), 0
        for token_id in ids:
            length += len(plain.add([token_id]))
            ends.add(length)
        start = rng.randrange(1, len(full) - 3)
        stop = full[start : start + rng.randint(2, 5)]
        spanning += any(start < end < start + len(stop) for end in ends)
        decoy = full[rng.randrange(len(full) - 2) :][:3]  # may occur before or after the other one
        stops = [stop, decoy, "\x00never"]
        rng.shuffle(stops)
        # cut where the first stop string to be completed starts (as if checked after every character)
        _, cut = min((i + len(s), i) for s in stops if (i := full.find(s)) >= 0)
        expected = full[:cut]
        for chunks in (None, rng):
            detokenizer = IncrementalDetokenizer(tokenizer, stops)
            emitted = stream(detokenizer, ids, chunks, expected)
            assert detokenizer.stopped and emitted == expected == detokenizer.text, (stops, emitted, expected)
    assert spanning > 20


def test_text_without_a_stop_is_whole_and_held_characters_are_released(request):
    tokenizer = get_tokenizer("smollm2", request)
    ids = list(tokenizer.encode("Ends with a partial stop: abc", add_special_tokens=False))
    detokenizer = IncrementalDetokenizer(tokenizer, ["abcd"])
    streamed = "".join(detokenizer.add([t]) for t in ids)
    assert streamed == "Ends with a partial stop: "[: len(streamed)] and not streamed.endswith("abc")  # held back
    streamed += detokenizer.add([], final=True)
    assert streamed == "Ends with a partial stop: abc" and not detokenizer.stopped


# ---- work per token --------------------------------------------------------------------------------------------------


class _CountingBackend:
    def __init__(self, inner, lengths: list[int]) -> None:
        self._inner, self._lengths = inner, lengths

    def decode(self, ids, skip_special_tokens=False):
        self._lengths.append(len(ids))
        return self._inner.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self._inner, name)


class CountingTokenizer:
    """A tokenizer that records how many ids every decode call is given."""

    def __init__(self, inner) -> None:
        self.lengths: list[int] = []
        self._inner = inner
        self.backend_tokenizer = _CountingBackend(inner.backend_tokenizer, self.lengths)

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self._inner.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("name", ["smollm2", "metaspace_cleanup"])
def test_work_per_token_does_not_grow_with_length(name, request):
    tokenizer = CountingTokenizer(get_tokenizer(name, request))
    unit = [t for s in CORPUS for t in tokenizer.encode(s + " ", add_special_tokens=False)]
    ids = (unit * (1200 // len(unit) + 1))[:1200]
    detokenizer = IncrementalDetokenizer(tokenizer, ["\x00never", "stop here"])
    per_token, text = [], ""
    for token_id in ids:
        before = sum(tokenizer.lengths)
        text += detokenizer.add([token_id])
        per_token.append(sum(tokenizer.lengths) - before)
    text += detokenizer.add([], final=True)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(per_token) <= 32  # ids decoded for one new token: a small constant, not its position (up to 1200)
    assert sum(per_token) <= 8 * len(ids)
    assert statistics.mean(per_token[-300:]) <= 1.5 * statistics.mean(per_token[:300]) + 1


# ---- the engine ------------------------------------------------------------------------------------------------------


def test_engine_decodes_incrementally_and_cuts_at_a_stop_string(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    prompt = list(engine.tokenizer.encode("The quick brown fox", add_special_tokens=False))
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    [free] = engine.generate([prompt], params)
    assert free.text == engine.tokenizer.decode(free.token_ids, skip_special_tokens=True)

    counting = engine.tokenizer = CountingTokenizer(engine.tokenizer)
    params.stop = ["\x00never"]
    [same] = engine.generate([prompt], params)
    assert same.text == free.text and same.finish_reason == "length"
    assert max(counting.lengths) <= 32 < len(free.token_ids)  # never the whole output (96 tokens) per step

    # a stop string across tokens, late in the output: the text is cut exactly there
    text = free.text
    start = next(i for i in range(len(text) // 2, len(text) - 4) if "\ufffd" not in text[i : i + 4])
    stop = text[start : start + 4]
    params.stop = [stop]
    [stopped] = engine.generate([prompt], params)
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.find(stop)]
    assert len(stopped.token_ids) < len(free.token_ids)


class _CountingList(list):
    contains_calls = 0

    def __contains__(self, item) -> bool:
        type(self).contains_calls += 1
        return super().__contains__(item)


def test_engine_checks_stop_token_ids_as_a_set(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [free] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stopper = free.token_ids[6]
    stop_ids = _CountingList(list(range(300, 350)) + [stopper])  # ids past the tiny vocabulary, then the stopper
    engine.add_request(
        [5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=stop_ids), request_id="r"
    )
    request = engine.requests["r"]
    while engine.has_unfinished():
        engine.step()
    assert request.finish_reason.value == "stop"
    assert request.output_token_ids == free.token_ids[: free.token_ids.index(stopper) + 1]
    assert _CountingList.contains_calls == 0  # no linear scan of the list per token


@pytest.mark.parametrize("name", ALL)
def test_streamed_text_keeps_special_tokens_when_asked(name, request):
    """skip_special_tokens=False: the deltas join to ``tokenizer.decode(ids, skip_special_tokens=False)``."""
    tokenizer = get_tokenizer(name, request)
    rng = random.Random(f"special-{name}")
    kept = 0
    for _ in range(100):
        ids = random_sequence(tokenizer, rng)
        expected = tokenizer.decode(ids, skip_special_tokens=False)
        for chunks in (None, rng):
            detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
            assert stream(detokenizer, ids, chunks, expected) == expected
            assert detokenizer.text == expected
        kept += expected != tokenizer.decode(ids, skip_special_tokens=True)
    assert kept > 10  # special tokens were there, and their text stayed
