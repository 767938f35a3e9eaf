"""ModelRunner: owns the paged KV tensors and runs one forward per step over a ragged batch.

The contract with the layer above (scheduler, generate loop) is a list of `SeqInput`s
(ids and counts, no tensors) in, a `StepOutput` out. One host sync per step: the
readback of the sampled ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4pool.errors import ContextLengthError
from ds4pool.model.attention import build_metadata
from ds4pool.model.grammar import apply_token_bitmask_
from ds4pool.model.loader import LoadedModel
from ds4pool.model.sampler import GREEDY, Sampler, SamplingParams


@dataclass(frozen=True)
class SeqInput:
    """One sequence's share of a step.

    # [0, num_computed)                         already in the KV cache
    # [num_computed, num_computed + len(ids))   computed by this step
    """

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]
    sample: bool = True  # False for a prompt chunk that is not the prompt's last
    sampling: SamplingParams = GREEDY
    seed: int = 0
    output_token_ids: Sequence[int] = ()  # generated so far: penalties and RNG step
    # host int32 [ceil(V / 32)], bit v set = token v allowed (grammar-constrained rows only)
    token_bitmask: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass(frozen=True)
class StepOutput:
    sampled: list[int | None]  # per SeqInput; None where sample=False
    logits: torch.Tensor | None = None  # [num_sampled, V] float32, when asked for


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int = 16) -> None:
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = cfg.max_position
        # Zero-filled, not empty: padded gathers read unused slots and mask them, and
        # 0 * NaN from uninitialised memory would poison the softmax output.
        shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=loaded.dtype, device=self.device)
            for _ in range(cfg.num_layers)
        ]
        self.sampler = Sampler(self.device)

    @staticmethod
    def blocks_for_bytes(loaded: LoadedModel, block_size: int, nbytes: int) -> int:
        per_token = loaded.config.kv_bytes_per_token(loaded.dtype.itemsize)
        return max(1, nbytes // (per_token * block_size))

    @property
    def kv_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def validate(self, seqs: Sequence[SeqInput]) -> None:
        """Host-side checks a bad batch would otherwise turn into a device fault."""
        vocab = self.loaded.config.vocab_size
        for s in seqs:
            if not s.token_ids:
                raise ValueError("a sequence in the batch has no tokens to compute")
            if s.context_len > self.max_model_len:
                raise ContextLengthError(
                    f"context of {s.context_len} tokens exceeds the model's {self.max_model_len}"
                )
            if s.context_len > len(s.block_table) * self.block_size:
                raise ValueError(
                    f"block table holds {len(s.block_table) * self.block_size} tokens, "
                    f"step needs {s.context_len}"
                )
            if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
                raise ValueError(f"token id outside the vocabulary [0, {vocab})")

    @torch.inference_mode()
    def step(self, seqs: Sequence[SeqInput], return_logits: bool = False) -> StepOutput:
        self.validate(seqs)
        meta = build_metadata(
            [len(s.token_ids) for s in seqs],
            [s.context_len for s in seqs],
            [list(s.block_table) for s in seqs],
            self.block_size,
            self.device,
            self.loaded.config.sliding_window,
        )
        flat = [t for s in seqs for t in s.token_ids]
        ids = torch.tensor(flat, dtype=torch.int64).to(self.device, non_blocking=True)
        hidden = self.model(ids, self.kv_caches, meta)  # [T, E]
        rows = [i for i, s in enumerate(seqs) if s.sample]
        if not rows:
            return StepOutput(sampled=[None] * len(seqs))
        ends, total = [], 0
        for s in seqs:
            total += len(s.token_ids)
            ends.append(total - 1)
        last = torch.tensor([ends[i] for i in rows], dtype=torch.int64).to(self.device)
        logits = self.model.compute_logits(hidden[last]).float()  # [R, V]
        masked = [(j, m) for j, i in enumerate(rows) if (m := seqs[i].token_bitmask) is not None]
        if masked:
            apply_token_bitmask_(logits, [j for j, _ in masked], [m for _, m in masked])
        sampled_t = self.sampler.sample(
            logits,
            [seqs[i].sampling for i in rows],
            [seqs[i].seed for i in rows],
            [seqs[i].output_token_ids for i in rows],
        )
        sampled_ids = sampled_t.tolist()  # the one host sync of the step
        out: list[int | None] = [None] * len(seqs)
        for i, tok in zip(rows, sampled_ids):
            out[i] = tok
        return StepOutput(sampled=out, logits=logits if return_logits else None)
