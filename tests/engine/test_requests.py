"""What a caller sees: stopping rules, sampling, aborts, and clear errors for bad input."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams


def test_max_tokens_and_finish_reasons(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [r] = engine.generate(["hi"], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(r.token_ids) == 5 and r.finish_reason == "length"


def test_stop_token_ids_and_eos(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [free] = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    stopper = free.token_ids[4]
    [stopped] = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stopper]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stopper) + 1]
    # with EOS as a stop token the engine stops there unless ignore_eos
    eos = next(iter(engine.eos_token_ids))
    engine.eos_token_ids.add(stopper)
    [at_eos] = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=0.0))
    [past_eos] = engine.generate(["abc"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.eos_token_ids.discard(stopper)
    assert eos in engine.eos_token_ids
    assert at_eos.finish_reason == "stop" and at_eos.token_ids[-1] == stopper
    assert past_eos.token_ids == free.token_ids


def test_stop_string_cuts_the_text(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    [free] = engine.generate(["The quick brown fox"], params)
    stop = engine.tokenizer.decode(free.token_ids[6:8])
    params.stop = [stop]
    [stopped] = engine.generate(["The quick brown fox"], params)
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text and free.text.startswith(stopped.text)
    assert len(stopped.token_ids) <= 8


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    [alone] = engine.generate(["once upon"], params)
    batch = engine.generate(
        ["once upon", "other prompt", "once upon"], [params, SamplingParams(temperature=0.7), params]
    )
    assert batch[0].token_ids == alone.token_ids == batch[2].token_ids
    [other_seed] = engine.generate(
        ["once upon"], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other_seed.token_ids != alone.token_ids


def test_top_k_one_is_greedy(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    [greedy] = engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    [top1] = engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=2.0, top_k=1, ignore_eos=True))
    [tiny_p] = engine.generate(["abc"], SamplingParams(max_tokens=10, temperature=2.0, top_p=1e-6, ignore_eos=True))
    assert greedy.token_ids == top1.token_ids == tiny_p.token_ids


def test_abort_frees_blocks_at_once_and_others_go_on(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    keep = engine.add_request("keep going", params)
    drop = engine.add_request("x" * 100, params)
    waiting = engine.add_request("never scheduled", params)
    for _ in range(3):
        engine.step()
    free_before = engine.num_free_blocks
    assert engine.abort(drop) and engine.abort(waiting)
    assert engine.num_free_blocks > free_before
    assert not engine.abort(drop)  # already gone
    done = [o for _ in range(40) for o in engine.step() if o.request_id == keep and o.finished]
    assert done and done[0].num_output_tokens == 30


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params_name_the_field(tiny_llama_path, make_engine, params, field):
    engine = make_engine(tiny_llama_path)
    with pytest.raises(ValueError, match=field):
        engine.add_request("hello", SamplingParams(**params))
    assert engine.generate(["still serving"], SamplingParams(max_tokens=2))[0].token_ids


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, max_model_len=64)
    running = engine.add_request("a running request", SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request("")
    with pytest.raises(ValueError, match="prompt must not be empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("y" * 64)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 2, 10**9])
    finished = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [running]


def test_generation_stops_at_max_model_len(tiny_llama_path, make_engine):
    engine = make_engine(tiny_llama_path, max_model_len=40)
    [r] = engine.generate(["z" * 30], SamplingParams(max_tokens=100, ignore_eos=True))
    assert r.finish_reason == "length" and r.num_prompt_tokens + len(r.token_ids) == 40


def test_bad_model_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="holds no model"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


@pytest.mark.parametrize(
    "settings, field",
    [(dict(dtype="float64"), "dtype"), (dict(block_size=0), "block_size"), (dict(device="tpu"), "device")],
)
def test_bad_engine_config_names_the_field(settings, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**settings)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engines_generate_and_hand_off(tiny_llama_path, make_engine, dtype):
    import torch

    engine = make_engine(tiny_llama_path, dtype=dtype)
    assert engine.kv_cache.kv[0].dtype == getattr(torch, dtype) and engine.kv_spec.bytes_per_token == 2 * 3 * 2 * 16 * 2
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [single] = engine.generate([[5, 6, 7] * 11], params)
    assert len(single.token_ids) == 8
    # the same prompt prefilled here and decoded in a second engine gives the same tokens in this dtype too
    other = make_engine(tiny_llama_path, dtype=dtype, enable_prefix_caching=False)
    blocks = other.kv_importer.reserve([5, 6, 7] * 11, params, "x")

    def sink(ready) -> None:  # the KV connector's report, in this dtype, into the other engine's reserved blocks
        assert ready.k.dtype == ready.v.dtype == getattr(torch, dtype)
        other.kv_importer.write("x", ready.layer, blocks[ready.first_block : ready.end_block], ready.k, ready.v)

    engine.add_request(
        [5, 6, 7] * 11, SamplingParams(max_tokens=1, temperature=0.0), "x", prefill_only=True, kv_sink=sink
    )
    [first] = [o for _ in range(5) for o in engine.step()]
    engine.release("x")
    other.kv_importer.tokens_in("x", [first.new_token_ids[0]])
    assert other.kv_importer.kv_done("x")
    tokens = list(first.new_token_ids)
    while other.has_unfinished():
        tokens += [t for o in other.step() for t in o.new_token_ids]
    assert tokens == single.token_ids
