"""RAM tier: host copies of session KV in a cachetools LRU bounded by bytes.

Each entry is one contiguous host tensor [L, 2, T, H_kv, D] (pinned when the device is
CUDA, so copies to and from the device are DMA transfers). When an insert pushes the
total over the budget, the least recently used entries are handed to `on_evict`
(the pool writes them to disk) before the insert completes, so the sum of entry sizes
never exceeds the budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import cachetools
import torch

from ds4pool.kv.session import SessionKey


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty host tensor, page-locked when the KV lives on a CUDA device."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _EvictingLRU(cachetools.LRUCache):
    """LRUCache that reports evictions and exposes its recency order (cachetools keeps
    that order private, and iterating the cache gives insertion order)."""

    def __init__(self, maxsize: int, on_evict: Callable[[SessionKey, torch.Tensor], None]):
        super().__init__(maxsize=maxsize, getsizeof=nbytes)
        self._on_evict = on_evict
        self.recency: OrderedDict[SessionKey, None] = OrderedDict()

    def __getitem__(self, key: SessionKey) -> torch.Tensor:
        value = super().__getitem__(key)
        self.recency.move_to_end(key)
        return value

    def __setitem__(self, key: SessionKey, value: torch.Tensor) -> None:
        super().__setitem__(key, value)  # may evict others first
        self.recency[key] = None
        self.recency.move_to_end(key)

    def __delitem__(self, key: SessionKey) -> None:
        super().__delitem__(key)
        self.recency.pop(key, None)

    def popitem(self) -> tuple[SessionKey, torch.Tensor]:
        # cachetools calls popitem() only to make room: that is an eviction.
        key, value = super().popitem()
        self._on_evict(key, value)
        return key, value


class RamTier:
    def __init__(
        self, budget_bytes: int, on_evict: Callable[[SessionKey, torch.Tensor], None]
    ) -> None:
        # LRUCache rejects a single value larger than maxsize with ValueError; keep
        # maxsize >= 1 so a zero budget means "nothing fits" rather than an error at start.
        self._cache = _EvictingLRU(max(1, budget_bytes), on_evict)
        self.budget_bytes = budget_bytes

    @property
    def used_bytes(self) -> int:
        return int(self._cache.currsize)

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: SessionKey) -> bool:
        return key in self._cache

    def fits(self, size: int) -> bool:
        return size <= self.budget_bytes

    def put(self, key: SessionKey, kv: torch.Tensor) -> None:
        """Insert (evicting LRU entries through on_evict). Raises ValueError if kv alone
        exceeds the budget; the caller decides where it goes instead."""
        if not self.fits(nbytes(kv)):
            raise ValueError("entry larger than the RAM budget")
        self._cache[key] = kv

    def get(self, key: SessionKey) -> torch.Tensor | None:
        """The entry (marking it most recently used), or None."""
        return self._cache.get(key)

    def pop(self, key: SessionKey) -> torch.Tensor | None:
        return self._cache.pop(key, None)

    def lru_keys(self) -> list[SessionKey]:
        """Keys from least to most recently used (the eviction order)."""
        return list(self._cache.recency)
