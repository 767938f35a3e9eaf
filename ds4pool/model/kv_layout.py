"""KVLayout: the one owner of the paged KV tensors' shape.

Every layer has one preallocated tensor

    cache [P, num_blocks + 1, block_size, H_kv, D]

with P planes per token: P = 2 for the per-head K/V of attention with KV heads
(K = cache[0], V = cache[1]; kind "kv"), P = 1 for multi-head latent attention (kind "mla":
the one plane holds each token's compressed latent, kv_lora_rank + qk_rope_head_dim values
as a single "head", H_kv = 1; see ds4pool/model/mla.py).

Token p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`, i.e. at flat slot `block * block_size + p % block_size` of the
[P, (num_blocks + 1) * block_size, H_kv, D] token view. Block ids [0, num_blocks) belong to
the block pool; the extra last block is scratch: padded rows of a CUDA-graph batch write
their (ignored) K/V there, so they never touch a session's blocks.

The runner, the attention backends, kv/transfer and the session pool ask this class for
views instead of assuming the shape; kv/transfer and the snapshot format move the P planes of
a token as they are, whatever the kind.

Memory order (`head_major`): the shape above is what every reader sees, but on CPU the bytes
are laid out [P, H_kv, num_blocks + 1, block_size, D] and the tensor is a permuted view of
them. Then one KV head of a run of consecutive blocks is one contiguous [L, D] matrix, and
the CPU decode kernel (attention_cpu) reads it 1.1-1.9x faster per layer than the same keys
interleaved with the other heads (docs/BENCHMARKS.md, "head-major"). Block and slot
indexing, `token_view` and index_select/index_copy_ work unchanged on the permuted view, but
index_select along the slot axis copies the whole layer to a contiguous temporary first
(45 ms for a block out of a demo layer): read slots by indexing (`view[:, slots]`, 7 µs;
kv/transfer.py). The Triton kernels need the plain contiguous order, so CUDA keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4pool.model.device import host_ints, upload

# Planes per token of each layout kind, and back.
PLANES_OF: dict[str, int] = {"kv": 2, "mla": 1}
KIND_OF: dict[int, str] = {p: k for k, p in PLANES_OF.items()}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int  # usable blocks; the tensors hold one more (scratch)
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_planes: int = 2  # 2: K and V ("kv"); 1: the latent of MLA ("mla")
    head_major: bool = False  # memory order [P, H_kv, N + 1, bs, D] (see the docstring)

    def __post_init__(self) -> None:
        assert self.num_planes in PLANES_OF.values(), self.num_planes

    @property
    def kind(self) -> str:
        """What the planes hold, "kv" or "mla" (recorded in snapshot fingerprints)."""
        return KIND_OF[self.num_planes]

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        return (
            self.num_planes,
            self.num_blocks + 1,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def scratch_slot(self) -> int:
        """A flat slot no session owns (the first of the scratch block)."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Every plane of one token over all layers."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.num_planes * self.num_layers * self.num_kv_heads * self.head_dim * item

    def allocate(self, device: torch.device) -> list[torch.Tensor]:
        # Zero-filled, not empty: padded reads of unused slots are masked, and 0 * NaN from
        # uninitialised memory would still poison a softmax.
        if not self.head_major:
            return [
                torch.zeros(self.layer_shape, dtype=self.dtype, device=device)
                for _ in range(self.num_layers)
            ]
        p, n, bs, h_kv, d = self.layer_shape
        return [
            torch.zeros((p, h_kv, n, bs, d), dtype=self.dtype, device=device).permute(
                0, 2, 3, 1, 4
            )  # [P, N + 1, bs, H_kv, D] over head-major memory
            for _ in range(self.num_layers)
        ]

    @staticmethod
    def keys(cache: torch.Tensor) -> torch.Tensor:  # [N + 1, bs, H_kv, D]
        return cache[0]

    @staticmethod
    def values(cache: torch.Tensor) -> torch.Tensor:  # [N + 1, bs, H_kv, D] ("kv" only)
        return cache[1]

    @staticmethod
    def token_view(cache: torch.Tensor) -> torch.Tensor:  # [P, (N + 1) * bs, H_kv, D]
        p, _, _, h_kv, d = cache.shape
        return cache.view(p, -1, h_kv, d)

    @staticmethod
    def of(kv_caches: Sequence[torch.Tensor]) -> KVLayout:
        """The layout of existing tensors."""
        first = kv_caches[0]
        p, n, bs, h_kv, d = first.shape
        head_major = not first.is_contiguous() and first.stride(3) > first.stride(1)
        return KVLayout(len(kv_caches), n - 1, bs, h_kv, d, first.dtype, p, head_major)

    def slots(self, blocks: Sequence[int], start: int, end: int) -> list[int]:
        """Flat slots of token positions [start, end) of a sequence with these blocks."""
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def slot_tensor(
        self, blocks: Sequence[int], start: int, end: int, device: torch.device
    ) -> torch.Tensor:
        """`slots` as an int64 tensor on `device`, computed there from the ids of the blocks
        the range spans (one small upload, pinned on CUDA): a session's restore or snapshot
        copy of 30k tokens built the list and its tensor in 5.4 ms of host time on the 2-core
        VM (0.24 ms this way), and on CUDA torch.tensor(..., device=) is a pageable copy,
        which waits for every kernel queued (the step in flight)."""
        bs = self.block_size
        if end <= start:
            return torch.empty(0, dtype=torch.int64, device=device)
        first = start // bs
        ids = upload(host_ints(list(blocks[first : -(-end // bs)])), device)
        pos = torch.arange(start, end, device=device)
        return ids[pos // bs - first] * bs + pos % bs
