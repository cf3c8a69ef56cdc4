"""benchmarks/published_profiles.py: the roofline against vLLM's published latencies stays where docs/planner.md
says, and Splitwise's measurements become a profile whose fits reproduce them."""

from __future__ import annotations

import pytest

from benchmarks.published_profiles import roofline_phases, splitwise_points, splitwise_profile, vllm_table

HEADER = "model,hardware,prompt_size,batch_size,token_size,peak_power,average_power,prompt_time,token_time,e2e_time,"


def test_the_roofline_is_within_11_percent_of_vllms_latency_table() -> None:
    rows = vllm_table()
    assert len(rows) == 6
    for model, degree, gpu, _, measured, estimate, error in rows:
        assert abs(error) < 0.11, (model, degree, gpu, measured, estimate)


def test_splitwise_rows_become_a_profile(tmp_path) -> None:
    path = tmp_path / "perf_model.csv"
    lines = [HEADER + "tensor_parallel"]
    for prompt, ms in ((512, 53.4), (1024, 77.9), (2048, 136.8), (4096, 390.3)):
        for repeat in (0.0, 1.0, -1.0):  # the median of the repeats is taken
            lines.append(f"llama2-70b,h100-80gb,{prompt},1,128,0,0,{ms + repeat},{30 + repeat},0,8")
    for batch, ms in ((2, 30.3), (8, 32.5), (32, 38.6)):
        lines.append(f"llama2-70b,h100-80gb,512,{batch},128,0,0,{batch * 60},{ms},0,8")
    lines.append("llama2-70b,h100-80gb,512,64,128,0,0,360.6,42.3,0,8")  # batch 64: left out
    lines.append("bloom-176b,h100-80gb,512,1,128,0,0,99,99,0,8")  # another model: left out
    path.write_text("\n".join(lines) + "\n")
    points = splitwise_points(str(path))
    assert list(points) == [("h100-80gb", 8)]
    assert len(points["h100-80gb", 8]) == 7 and points["h100-80gb", 8][0][3:] == pytest.approx((0.0534, 0.030))
    profile = splitwise_profile(points["h100-80gb", 8], "h100-80gb", 8)
    assert profile.backend == "published" and "Splitwise" in profile.device and profile.tensor_parallel_size == 8
    assert profile.prefill_s(2048) == pytest.approx(0.1368, rel=0.25)
    assert profile.decode_step_s(8, 8 * (512 + 64)) == pytest.approx(0.0325, rel=0.1)
    assert profile.kv_blocks > 0 and profile.transfer_fit is not None  # the roofline's
    prompt_s, token_s = roofline_phases(profile, 512, 1, 128)
    assert prompt_s == pytest.approx(profile.prefill_s(512)) and token_s > 0
