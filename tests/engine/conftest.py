from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.helpers.engine import Reference


@pytest.fixture(scope="session")
def llama_reference(tiny_llama_path) -> Reference:
    return Reference(tiny_llama_path)


@pytest.fixture(scope="session")
def qwen2_reference(tiny_qwen2_path) -> Reference:
    return Reference(tiny_qwen2_path)


@pytest.fixture
def make_engine():
    """Build engines for a test and check, after it, that none holds a block or a request."""
    engines: list[LLMEngine] = []

    def factory(model, **overrides) -> LLMEngine:
        # a compiled decode step compiles (or loads) before the engine is returned, never in the background
        settings = dict(model=str(model), kv_blocks=256, compile_decode_background=False)
        settings.update(overrides)
        engine = LLMEngine(EngineConfig(**settings))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.check_no_leaks()
