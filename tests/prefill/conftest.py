"""Fixtures: ``role_pair(**options)`` makes a prefill role and a decode role joined by the local transfer backend."""

from __future__ import annotations

import pytest

from tests.helpers.roles import RolePairs


@pytest.fixture
def role_pair(tiny_llama_path):
    with RolePairs(tiny_llama_path) as pairs:
        yield pairs.make
