"""``pdserve bench serve`` and ``bench compare`` on a machine that never served pdserve's built-in model: the load
tester reads the model's tokenizer from where pdserve converts it and imports nothing of pdserve, so the CLI converts
it first, as ``pdserve serve`` would; with a ``--tokenizer``, a model folder, or the model already converted, it
converts nothing."""

from __future__ import annotations

import argparse

import pytest

import engine.model_loader
from bench.loadtest.options import PDSERVE_DEFAULT_MODEL
from cli.main import _convert_builtin_model


@pytest.fixture
def conversions(monkeypatch, tmp_path) -> list[str]:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    made: list[str] = []

    def convert(name: str):
        made.append(name)
        folder = tmp_path / "cache" / "models" / name
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        return folder

    monkeypatch.setattr(engine.model_loader, "resolve_model_path", convert)
    return made


def _serve(**options) -> argparse.Namespace:
    return argparse.Namespace(bench_command="serve", tokenizer=None, model=PDSERVE_DEFAULT_MODEL, **options)


def test_a_fresh_machine_converts_the_builtin_model_once(conversions):
    _convert_builtin_model(_serve())
    assert conversions == [PDSERVE_DEFAULT_MODEL]
    _convert_builtin_model(_serve())  # converted now: nothing more
    _convert_builtin_model(argparse.Namespace(bench_command="serve", tokenizer=None, model="served-name"))
    assert conversions == [PDSERVE_DEFAULT_MODEL]


def test_a_tokenizer_or_a_model_folder_needs_no_conversion(conversions, tmp_path):
    _convert_builtin_model(argparse.Namespace(bench_command="serve", tokenizer=str(tmp_path), model=None))
    _convert_builtin_model(argparse.Namespace(bench_command="serve", tokenizer=None, model=str(tmp_path)))
    assert conversions == []


def test_compare_looks_at_its_configs_model(conversions, tmp_path):
    config = tmp_path / "cluster.yaml"
    config.write_text(f"model:\n  name: {tmp_path}\n")
    _convert_builtin_model(argparse.Namespace(bench_command="compare", tokenizer=None, config=str(config)))
    assert conversions == []  # a folder model: its own tokenizer
    config.write_text(f"model:\n  name: {PDSERVE_DEFAULT_MODEL}\n")
    _convert_builtin_model(argparse.Namespace(bench_command="compare", tokenizer=None, config=str(config)))
    assert conversions == [PDSERVE_DEFAULT_MODEL]
