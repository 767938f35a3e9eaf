"""Copies of one session's KV between the paged device cache and a contiguous host tensor.

Host layout: [L, 2, T, H_kv, D] (layer, K/V, token, head, dim), used tokens only. The
device layout is KVLayout's (ds4pool/model/kv_layout.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ds4pool.kv.ram import host_buffer
from ds4pool.model.kv_layout import KVLayout


def token_slots(blocks: Sequence[int], num_tokens: int, block_size: int) -> list[int]:
    """Flat cache slot of each of the first num_tokens tokens."""
    return [blocks[p // block_size] * block_size + p % block_size for p in range(num_tokens)]


def gather_to_host(
    kv_caches: Sequence[torch.Tensor], blocks: Sequence[int], num_tokens: int, block_size: int
) -> torch.Tensor:
    """Device blocks → a new host tensor [L, 2, T, H_kv, D] (pinned on CUDA)."""
    layout = KVLayout.of(kv_caches)
    device = kv_caches[0].device
    shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
    out = host_buffer(shape, layout.dtype, device)
    if num_tokens == 0:
        return out
    slots = torch.tensor(token_slots(blocks, num_tokens, block_size), device=device)
    staged = torch.stack([KVLayout.token_view(c).index_select(1, slots) for c in kv_caches])
    out.copy_(staged, non_blocking=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return out


def scatter_from_host(
    kv_caches: Sequence[torch.Tensor],
    host: torch.Tensor | Sequence[torch.Tensor],  # [L, 2, T, H, D] or L × [2, T', H, D]
    blocks: Sequence[int],
    num_tokens: int,
    block_size: int,
) -> None:
    """Write the first num_tokens tokens of `host` into the device blocks."""
    if num_tokens == 0:
        return
    device = kv_caches[0].device
    slots = torch.tensor(token_slots(blocks, num_tokens, block_size), device=device)
    for layer, cache in enumerate(kv_caches):
        src = host[layer][:, :num_tokens].to(device, non_blocking=True)
        KVLayout.token_view(cache).index_copy_(1, slots, src)


def copy_block(kv_caches: Sequence[torch.Tensor], src: int, dst: int) -> None:
    """Copy device block src's K and V into block dst, every layer (copy-on-write)."""
    for cache in kv_caches:
        for part in (KVLayout.keys(cache), KVLayout.values(cache)):
            part[dst].copy_(part[src])
