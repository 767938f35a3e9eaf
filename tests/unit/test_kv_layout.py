"""KVLayout's memory orders: the head-major CPU cache holds what the token-major one does."""

from __future__ import annotations

import torch

from ds4pool.model.attention import write_kv
from ds4pool.model.kv_layout import KVLayout


def layouts() -> tuple[KVLayout, KVLayout]:
    args = (3, 5, 4, 2, 8, torch.float32)  # layers, blocks, block size, H_kv, D, dtype
    return KVLayout(*args), KVLayout(*args, head_major=True)


def test_head_major_caches_hold_the_same_values_at_the_same_indices() -> None:
    token, head = layouts()
    plain, permuted = token.allocate(torch.device("cpu")), head.allocate(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    slots = torch.tensor(token.slots([4, 1, 3], 2, 11))  # 9 tokens over three blocks
    for a, b in zip(plain, permuted):
        k, v = torch.randn(2, len(slots), 2, 8, generator=gen)
        write_kv(a, k, v, slots)
        write_kv(b, k, v, slots)
        assert b.shape == a.shape == token.layer_shape
        assert torch.equal(a, b)
        assert torch.equal(a[0, 1], b[0, 1]) and torch.equal(a[1][[4, 3]], b[1][[4, 3]])
    assert KVLayout.of(plain) == token and KVLayout.of(permuted) == head


def test_head_major_memory_makes_each_heads_slots_one_matrix() -> None:
    _, head = layouts()
    cache = head.allocate(torch.device("cpu"))[0]
    tokens = KVLayout.token_view(cache)  # a view, not a copy: writes through it land in cache
    assert tokens.data_ptr() == cache.data_ptr()
    keys = KVLayout.keys(cache)  # [N + 1, bs, H_kv, D]
    per_head = keys.permute(2, 0, 1, 3).flatten(1, 2)  # [H_kv, slots, D]: no copy needed
    assert per_head.data_ptr() == keys.data_ptr() and per_head[1].is_contiguous()
    assert not KVLayout.of([cache.contiguous()]).head_major
