"""Fixtures for transfer tests: a spawn context, and teardown that closes every sender/receiver a test made (so no
socket or thread outlives it). Payloads, the destination cache and the peer processes are in tests/helpers/."""

from __future__ import annotations

import multiprocessing as mp

import pytest


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
