"""TritonOps' one-launch RoPE of q and k needs one [T, H + H_kv, D] view over both: only
when k's heads really follow q's in the same storage (a fused qkv output), never across
two tensors that the allocator happened to place side by side (q/k-norm outputs)."""

from __future__ import annotations

import numpy as np
import torch

from ds4pool.model.ops import _adjacent_heads


def test_fused_qkv_slices_share_one_view() -> None:
    t, h, hk, d = 3, 4, 2, 8
    qkv = torch.randn(t, (h + 2 * hk) * d)
    q = qkv[:, : h * d].view(t, h, d)
    k = qkv[:, h * d : (h + hk) * d].view(t, hk, d)
    both = _adjacent_heads(q, k)
    assert both is not None
    assert torch.equal(both[:, :h], q) and torch.equal(both[:, h:], k)


def test_adjacent_memory_in_two_storages_gets_no_view() -> None:
    h, hk, d = 4, 2, 8
    memory = np.zeros((h + hk) * d, dtype=np.float32)  # one block, two tensors over it
    q = torch.from_numpy(memory[: h * d]).view(1, h, d)
    k = torch.from_numpy(memory[h * d :]).view(1, hk, d)
    assert k.data_ptr() == q.data_ptr() + h * d * q.element_size()
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    assert _adjacent_heads(q, k) is None  # was: a view past q's storage (RuntimeError)
