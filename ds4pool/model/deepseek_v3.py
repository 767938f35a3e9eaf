"""DeepSeek-V3 (DeepseekV3ForCausalLM) over a paged latent KV cache.

Multi-head latent attention in every layer (ds4pool/model/mla.py); the first
`first_k_dense_replace` layers have a dense gated MLP, the others a mixture of experts with
DeepSeek's router and shared experts. Parameter names are Hugging Face's. The runner's
contract is the Llama family's: forward(input_ids, kv_caches, meta) → hidden [T, E],
compute_logits on the rows that need them. Shapes: T = tokens in the step, E = hidden size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.attention_mla import MLABackend, TorchMLAAttention
from ds4pool.model.causal_lm import PagedCausalLM
from ds4pool.model.config import ModelConfig
from ds4pool.model.layers import GatedMLP, RMSNorm, RotaryEmbedding
from ds4pool.model.mla import MLAAttention
from ds4pool.model.moe import SparseMoeBlock
from ds4pool.model.ops import TorchOps


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: MLABackend, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg, backend)
        self.mlp: GatedMLP | SparseMoeBlock
        if cfg.moe is not None and layer_idx in cfg.moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size)  # DeepSeek router + shared
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,  # [T, E] input_layernorm(residual), done by the caller
        residual: torch.Tensor,  # [T, E] the stream before this layer
        next_norm: RMSNorm,  # the next layer's input norm, or the final norm
        rope: Any,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next_norm(residual'), residual'), as LlamaDecoderLayer."""
        a = self.self_attn(h, rope, cache, meta, ops)
        residual, h = ops.add_rms_norm(self.post_attention_layernorm, a, residual)
        if isinstance(self.mlp, GatedMLP):  # the dense layers: down, add and norm as one op
            residual, h = self.mlp.add_norm(h, residual, next_norm, ops)
        else:
            residual, h = ops.add_rms_norm(next_norm, self.mlp(h, ops), residual)
        return h, residual


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: MLABackend) -> None:
        super().__init__()
        assert cfg.mla is not None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.mla.qk_rope_head_dim, cfg.rope)


class DeepseekV3ForCausalLM(PagedCausalLM):
    """DeepSeek-V3's layers in the shared decoder forward (model/causal_lm.py)."""

    def __init__(self, cfg: ModelConfig, backend: MLABackend | None = None) -> None:
        super().__init__(cfg, DeepseekV3Model(cfg, backend or TorchMLAAttention()))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return self.model.rotary_emb(positions, dtype)  # cos, sin [T, 1, r]

    def float32_modules(self) -> list[nn.Module]:
        """Modules kept in float32 whatever the model dtype, as transformers keeps them
        (`_keep_in_fp32_modules_strict`): the routers' weight and e_score_correction_bias,
        whose rounding to bf16 would change which experts a token picks."""
        return [
            layer.mlp.gate for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)
        ]

    def fuse_projections(self) -> None:
        """After loading: gate/up → gate_up_proj in the dense MLPs and shared experts."""
        for layer in self.model.layers:
            layer.mlp.fuse()
