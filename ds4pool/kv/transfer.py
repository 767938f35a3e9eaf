"""Copies of one session's KV between the paged device cache and a contiguous host tensor.

Host layout: [L, P, T, H_kv, D] (layer, plane, token, head, dim), used tokens only. P is the
layout's number of planes (2 for K/V, 1 for an MLA latent), moved as it is: nothing here
depends on what the planes hold. The device layout belongs to the model
(`model/kv_layout.py`'s `KVLayout`, or a model's own); kv/ receives it with the tensors as a
`DeviceKV` and never imports the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ds4pool.kv.ram import host_buffer


class PagedLayout(Protocol):
    """What kv/ needs to know of the paged tensors' layout (KVLayout satisfies it)."""

    @property
    def bytes_per_token(self) -> int: ...

    def token_view(self, cache: torch.Tensor) -> torch.Tensor:
        """One layer's cache as [2, slots, H_kv, D] (K/V, flat slot, head, dim)."""
        ...

    def slots(self, blocks: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slots of token positions [start, end) of a sequence with these blocks."""
        ...

    def slot_tensor(
        self, blocks: Sequence[int], start: int, end: int, device: torch.device
    ) -> torch.Tensor:
        """`slots` as an int64 tensor on `device` (no list of every token's slot)."""
        ...


@dataclass(frozen=True)
class DeviceKV:
    """The paged KV tensors (one per layer, owned by the runner) and their layout."""

    caches: Sequence[torch.Tensor]
    layout: PagedLayout

    @property
    def device(self) -> torch.device:
        return self.caches[0].device


def gather_to_host(kv: DeviceKV, blocks: Sequence[int], num_tokens: int) -> torch.Tensor:
    """Device blocks → a new host tensor [L, P, T, H_kv, D] (pinned on CUDA)."""
    first = kv.layout.token_view(kv.caches[0])  # [P, S, H_kv, D]
    shape = (len(kv.caches), first.shape[0], num_tokens, *first.shape[2:])
    out = host_buffer(shape, first.dtype, kv.device)
    if num_tokens == 0:
        return out
    slots = kv.layout.slot_tensor(blocks, 0, num_tokens, kv.device)
    if kv.device.type == "cpu":
        # Indexing, not index_select: on the CPU's head-major cache (a permuted view) torch's
        # index_select copied the whole layer to a contiguous temporary first (30-37 ms a
        # layer for the demo's 0.5 GB pool, whatever the session's length), indexing reads
        # the selected slots only (8 µs for a block). bench/host_metadata.py measures both.
        for layer, cache in enumerate(kv.caches):
            out[layer].copy_(kv.layout.token_view(cache)[:, slots])
        return out
    staged = torch.stack([kv.layout.token_view(c).index_select(1, slots) for c in kv.caches])
    out.copy_(staged, non_blocking=kv.device.type == "cuda")
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()
    return out


def scatter_from_host(
    kv: DeviceKV,
    host: torch.Tensor | Sequence[torch.Tensor],  # [L, P, T, H, D] or L × [P, T', H, D]
    blocks: Sequence[int],
    num_tokens: int,
) -> None:
    """Write the first num_tokens tokens of `host` into the device blocks."""
    if num_tokens == 0:
        return
    slots = kv.layout.slot_tensor(blocks, 0, num_tokens, kv.device)
    for layer, cache in enumerate(kv.caches):
        src = host[layer][:, :num_tokens].to(kv.device, non_blocking=True)
        kv.layout.token_view(cache).index_copy_(1, slots, src)


def synchronize(kv: DeviceKV) -> None:
    """Wait for the copies queued on the device's current stream (a no-op off CUDA)."""
    if kv.device.type == "cuda":
        torch.cuda.current_stream(kv.device).synchronize()


def copy_block(kv: DeviceKV, src: int, dst: int, block_size: int) -> None:
    """Copy device block src's K and V into block dst, every layer (copy-on-write)."""
    src_slots = kv.layout.slot_tensor([src], 0, block_size, kv.device)
    dst_slots = kv.layout.slot_tensor([dst], 0, block_size, kv.device)
    for cache in kv.caches:
        view = kv.layout.token_view(cache)  # [2, slots, H_kv, D]
        view.index_copy_(1, dst_slots, view[:, src_slots])  # indexing: see gather_to_host
