"""Fixtures for transfer tests: make tests/transfer importable for spawned peers, a spawn context,
and teardown that closes every sender/receiver a test made (so no socket or thread outlives it)."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def spawn():
    return mp.get_context("spawn")


@pytest.fixture
def closing():
    """Register endpoints with closing(obj); they are closed after the test, even on failure."""
    objs: list = []

    def add(obj):
        objs.append(obj)
        return obj

    yield add
    for o in reversed(objs):
        o.close()
