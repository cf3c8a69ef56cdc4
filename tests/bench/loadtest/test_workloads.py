import json
import shutil

import numpy as np
import pytest

from bench.loadtest.workloads import PromptBuilder, WorkloadSettings, build_requests, draw_lengths, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(byte_tokenizer_dir):
    return load_tokenizer(str(byte_tokenizer_dir))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prompts_have_exact_token_counts(tokenizer, endpoint):
    builder = PromptBuilder(tokenizer, endpoint, seed=1)
    base = builder.overhead()
    for target in (base + 1, base + 17, 300, 1000):
        text = builder.build(target)
        assert builder.count(text) == target
    with pytest.raises(ValueError, match="already takes"):
        builder.build(base)


def test_chat_count_is_the_templated_prompt(tokenizer):
    builder = PromptBuilder(tokenizer, "chat")
    text = builder.build(100)
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    assert len(tokenizer(templated, add_special_tokens=False)["input_ids"]) == 100


def test_real_bpe_tokenizer_exact_counts():
    """The default model's BPE tokenizer merges across word boundaries; the builder must still be exact."""
    try:
        tok = load_tokenizer()
    except Exception as exc:  # the default model is not converted on this machine
        pytest.skip(f"default tokenizer unavailable: {exc}")
    for endpoint in ("completions", "chat"):
        builder = PromptBuilder(tok, endpoint, seed=3)
        for target in (40, 257, 1000):
            assert builder.count(builder.build(target)) == target


def test_without_a_tokenizer_the_built_in_models_is_found_in_pdserves_cache(byte_tokenizer_dir, tmp_path, monkeypatch):
    """No --tokenizer and no model folder: the tokenizer pdserve saved with its built-in model, by name, from
    $PDSERVE_CACHE (nothing of pdserve imported); not converted there yet, an error that names --tokenizer."""
    from bench.loadtest.options import PDSERVE_DEFAULT_MODEL

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="give --tokenizer"):
        load_tokenizer(None, PDSERVE_DEFAULT_MODEL)
    folder = tmp_path / "models" / PDSERVE_DEFAULT_MODEL
    shutil.copytree(byte_tokenizer_dir, folder)
    (folder / "config.json").write_text("{}")
    for model in (None, PDSERVE_DEFAULT_MODEL, "some-served-name"):  # any other name: the built-in model's tokenizer
        tok = load_tokenizer(None, model)
        assert tok.decode(tok("hello", add_special_tokens=False)["input_ids"]) == "hello"
        assert tok.name_or_path == str(folder)
    assert load_tokenizer(str(byte_tokenizer_dir), "some-served-name").name_or_path == str(byte_tokenizer_dir)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert draw_lengths(100, 5, "fixed", rng) == [100] * 5
    uniform = draw_lengths(100, 2000, "uniform", rng, range_ratio=0.5)
    assert min(uniform) >= 50 and max(uniform) <= 150 and np.mean(uniform) == pytest.approx(100, rel=0.03)
    normal = draw_lengths(100, 4000, "normal", rng, cv=0.2)
    assert np.mean(normal) == pytest.approx(100, rel=0.02) and np.std(normal) == pytest.approx(20, rel=0.1)
    lognormal = draw_lengths(100, 4000, "lognormal", rng, cv=0.5)
    assert np.mean(lognormal) == pytest.approx(100, rel=0.05) and min(lognormal) >= 1
    assert min(draw_lengths(5, 1000, "normal", rng, cv=2.0, minimum=3)) >= 3


def test_random_and_shared_prefix_workloads(tokenizer):
    builder = PromptBuilder(tokenizer, "completions", seed=0)
    specs = build_requests(
        WorkloadSettings(random_input_len=64, random_output_len=8, random_range_ratio=0.25), builder, 20
    )
    assert all(builder.count(s.prompt) == s.input_tokens for s in specs)
    assert len({s.input_tokens for s in specs}) > 1 and all(48 <= s.input_tokens <= 80 for s in specs)
    shared = build_requests(
        WorkloadSettings(
            dataset_name="shared-prefix", shared_prefix_groups=3, shared_prefix_len=200, random_input_len=20
        ),
        builder,
        9,
    )
    assert [s.group for s in shared] == [0, 1, 2] * 3
    assert len({s.system for s in shared}) == 3
    assert all(shared[i].system == shared[i + 3].system for i in range(6))
    for s in shared:
        assert builder.count(s.prompt, s.system) == s.input_tokens == 200 + 1 + 20  # prefix + "\n" + question
    chat = PromptBuilder(tokenizer, "chat", seed=0)
    for s in build_requests(
        WorkloadSettings(dataset_name="shared-prefix", shared_prefix_len=50, random_input_len=10), chat, 4
    ):
        assert chat.count(s.prompt, s.system) == s.input_tokens


def test_jsonl_and_sharegpt_files(tokenizer, tmp_path):
    builder = PromptBuilder(tokenizer, "completions")
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_text('{"prompt": "hello there", "output_tokens": 5}\n\n{"prompt": "bye"}\n')
    specs = build_requests(
        WorkloadSettings(dataset_name="jsonl", dataset_path=str(jsonl), random_output_len=9), builder, 3
    )
    assert [(s.prompt, s.output_tokens, s.input_tokens) for s in specs] == [
        ("hello there", 5, 11),
        ("bye", 9, 3),
        ("hello there", 5, 11),
    ]
    jsonl.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="w.jsonl:1"):
        build_requests(WorkloadSettings(dataset_name="jsonl", dataset_path=str(jsonl)), builder, 1)
    share = tmp_path / "sg.json"
    share.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "abc"}, {"from": "gpt", "value": "four"}]},
                {"conversations": [{"from": "human", "value": "only a question"}]},
                {
                    "conversations": [
                        {"from": "system", "value": "s"},
                        {"from": "human", "value": "q2"},
                        {"from": "gpt", "value": "answer!"},
                        {"from": "human", "value": "more"},
                    ]
                },
            ]
        )
    )
    specs = build_requests(WorkloadSettings(dataset_name="sharegpt", dataset_path=str(share)), builder, 2)
    assert sorted((s.prompt, s.output_tokens) for s in specs) == [("abc", 4), ("q2", 7)]
    with pytest.raises(ValueError, match="needs --dataset-path"):
        build_requests(WorkloadSettings(dataset_name="sharegpt"), builder, 1)
