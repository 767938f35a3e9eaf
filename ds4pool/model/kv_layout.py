"""KVLayout: the one owner of the paged KV tensors' shape.

Every layer has one preallocated tensor

    cache [2, num_blocks + 1, block_size, H_kv, D]     # K = cache[0], V = cache[1]

Token p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`, i.e. at flat slot `block * block_size + p % block_size` of the
[2, (num_blocks + 1) * block_size, H_kv, D] token view. Block ids [0, num_blocks) belong to
the block pool; the extra last block is scratch: padded rows of a CUDA-graph batch write
their (ignored) K/V there, so they never touch a session's blocks.

The runner, the attention backends, kv/transfer and the session pool ask this class for
views instead of assuming the shape. A model with another cache (e.g. a latent one) brings
its own layout with the same methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int  # usable blocks; the tensors hold one more (scratch)
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (2, self.num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def scratch_slot(self) -> int:
        """A flat slot no session owns (the first of the scratch block)."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * item

    def allocate(self, device: torch.device) -> list[torch.Tensor]:
        # Zero-filled, not empty: padded reads of unused slots are masked, and 0 * NaN from
        # uninitialised memory would still poison a softmax.
        return [
            torch.zeros(self.layer_shape, dtype=self.dtype, device=device)
            for _ in range(self.num_layers)
        ]

    @staticmethod
    def keys(cache: torch.Tensor) -> torch.Tensor:  # [N + 1, bs, H_kv, D]
        return cache[0]

    @staticmethod
    def values(cache: torch.Tensor) -> torch.Tensor:  # [N + 1, bs, H_kv, D]
        return cache[1]

    @staticmethod
    def token_view(cache: torch.Tensor) -> torch.Tensor:  # [2, (N + 1) * bs, H_kv, D]
        _, _, _, h_kv, d = cache.shape
        return cache.view(2, -1, h_kv, d)

    @staticmethod
    def of(kv_caches: Sequence[torch.Tensor]) -> KVLayout:
        """The layout of existing tensors."""
        first = kv_caches[0]
        _, n, bs, h_kv, d = first.shape
        return KVLayout(len(kv_caches), n - 1, bs, h_kv, d, first.dtype)

    def slots(self, blocks: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slots of token positions [start, end) of a sequence with these blocks."""
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]
