"""``pdserve`` subcommands run in-process or as a user runs them: a tiny model built, a bad model reported, the demo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cli.main import main


def test_model_tiny_builds_a_loadable_model(tmp_path, capsys):
    assert main(["model", "tiny", str(tmp_path / "m"), "--arch", "qwen2"]) == 0
    assert (tmp_path / "m" / "config.json").exists()
    assert "qwen2" in (tmp_path / "m" / "config.json").read_text()


def test_model_tiny_offers_every_tiny_family(tmp_path):
    from cli.main import TINY_ARCHITECTURE_NAMES
    from engine.tiny_model import TINY_ARCHITECTURES

    assert TINY_ARCHITECTURE_NAMES == list(TINY_ARCHITECTURES)
    assert main(["model", "tiny", str(tmp_path / "m"), "--arch", "gpt_oss"]) == 0
    assert '"model_type": "gpt_oss"' in (tmp_path / "m" / "config.json").read_text()


def test_bad_model_is_a_clear_error_not_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "bench", "engine", "--model", str(tmp_path / "nope"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_demo_answers_with_the_default_model(capsys):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    assert main(["demo", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "ttft_ms_median" in out
    moved = float(out.split("KV moved prefill -> decode: ")[1].split(" MB")[0])
    assert moved > 0  # the KV really crossed from the prefill worker to the decode worker
    # a clean cache: the compiled step compiles in the background meanwhile, so decode ran eagerly, and says so
    assert "decode ran eagerly: the compiled step is compiling in the background" in out
