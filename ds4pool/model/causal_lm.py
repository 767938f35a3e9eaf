"""What the decoder-only families share (model/llama.py, model/deepseek_v3.py): a `model`
of embedding → pre-norm layers → final norm, and a separate LM head.

One forward per step over a ragged batch returns hidden states [T, E]; each layer's residual
add is fused with the norm that reads it (the next layer's input norm, or the final norm).
Logits are computed apart (`compute_logits`) and only for the rows that need them, usually
the last token of each sequence: the LM head is the largest matmul. A family gives its
`model` (with `embed_tokens`, `layers`, `norm`, `rotary_emb`) and how it turns positions
into RoPE inputs (`rope`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.config import ModelConfig
from ds4pool.model.experts import SYNC_FREE, expert_impl
from ds4pool.model.moe import SparseMoeBlock
from ds4pool.model.ops import TorchOps


class PagedCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, model: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.ops: TorchOps = TorchOps()
        self.model = model
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """What the attention layers get to rotate q and k at `positions`."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer, the runner's KVLayout
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, E]
        ops, layers = self.ops, self.model.layers
        residual = self.model.embed_tokens(input_ids)
        rope = self.rope(meta.positions, residual.dtype)
        h = ops.rms_norm(layers[0].input_layernorm, residual)
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        for layer, cache, next_norm in zip(layers, kv_caches, norms):
            h, residual = layer(h, residual, next_norm, rope, cache, meta, ops)
        return h

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a step's forward may be captured: dense models always; MoE models where the
        experts run on a sync-free grouped path (model/experts.py), not the per-expert loop."""
        weight = self.model.embed_tokens.weight
        return all(
            expert_impl(weight.device, weight.dtype, m.impl) in SYNC_FREE
            for m in self.modules()
            if isinstance(m, SparseMoeBlock)
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, E] → [N, V]
        return self.ops.linear(self.lm_head, hidden)

    def set_attention_backend(self, backend: Any, ops: TorchOps) -> None:
        """The runner's choice: the attention backend and the elementwise kernels that go
        with it."""
        self.ops = ops
        for layer in self.model.layers:
            layer.self_attn.backend = backend
