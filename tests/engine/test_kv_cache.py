"""The KV cache's storage: ``rehome`` moves it into tensors the caller made (the decode worker's shared segment)."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import KVCache, KVSpec


def _cache() -> KVCache:
    return KVCache(KVSpec("llama", torch.float32, 2, 2, 4, 4), num_blocks=3)


def test_rehome_keeps_the_contents_and_every_view_follows() -> None:
    cache = _cache()
    cache.write_blocks(1, [2], torch.ones(1, 4, 2, 4), torch.full((1, 4, 2, 4), 2.0))
    new = [torch.empty_like(kv) for kv in cache.kv]
    cache.rehome(new)
    assert all(a is b for a, b in zip(cache.kv, new))
    assert cache.k[1].data_ptr() == new[1][0].data_ptr() and cache.v[1].data_ptr() == new[1][1].data_ptr()
    k, v = cache.read_blocks(1, [2])
    assert bool((k == 1).all()) and bool((v == 2).all())


@pytest.mark.parametrize("bad", ["count", "shape", "dtype"])
def test_rehome_refuses_storage_of_another_shape(bad) -> None:
    cache = _cache()
    new = [torch.empty_like(kv) for kv in cache.kv]
    if bad == "count":
        new = new[:1]
    elif bad == "shape":
        new[0] = torch.empty(2, 2, 4, 2, 4)
    else:
        new[1] = new[1].double()
    before = [kv.data_ptr() for kv in cache.kv]
    with pytest.raises(ValueError, match="new KV storage"):
        cache.rehome(new)
    assert [kv.data_ptr() for kv in cache.kv] == before
