"""The decoder-only Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache, and
its mixture-of-experts variants (Qwen3-MoE, Mixtral): the same attention, with a
`SparseMoeBlock` (model/moe.py) as the MLP of the layers `cfg.moe.sparse_layers` names.

Parameter names are Hugging Face's, so loading a checkpoint is a plain name → tensor
mapping (stacked experts: see model/registry.py). Shapes: T = tokens in the step (all
sequences flattened), H = query heads, H_kv = key/value heads, D = head_dim, E = hidden size,
V = vocab.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds4pool.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from ds4pool.model.causal_lm import PagedCausalLM
from ds4pool.model.config import ModelConfig
from ds4pool.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, fuse_linears
from ds4pool.model.moe import SparseMoeBlock
from ds4pool.model.ops import TorchOps


class LlamaAttention(nn.Module):
    """q/k/v projections are separate on disk (HF names); `fuse()` turns them into one
    `qkv_proj` matmul after loading (one GEMM read of the weights instead of three)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        e = cfg.hidden_size
        self.q_proj = nn.Linear(e, cfg.q_size, bias=qkv_bias)
        self.k_proj = nn.Linear(e, cfg.kv_size, bias=qkv_bias)
        self.v_proj = nn.Linear(e, cfg.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, e, bias=cfg.attention_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.scale = cfg.head_dim**-0.5
        self.backend = backend
        self.qkv_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        rope: Any,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> torch.Tensor:
        return ops.linear(self.o_proj, self.attend(x, rope, cache, meta, ops))

    def attend(
        self,
        x: torch.Tensor,  # [T, E]
        rope: Any,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> torch.Tensor:
        """The attention's output before o_proj, [T, H * D]."""
        t = x.shape[0]
        if self.qkv_proj is not None:
            qs, kvs = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = ops.linear(self.qkv_proj, x).split((qs, kvs, kvs), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q_norm, k_norm = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
        # a decode-only Triton step: the prologue inside the decode kernel (one launch)
        out = ops.decode_attention(
            self.backend, q, k, v, rope, cache, meta, self.scale, q_norm, k_norm
        )
        if out is None:
            # norms + RoPE, and on the Triton path the KV store too (one launch): kv_stored
            q, k, stored = ops.attention_prologue(
                q, k, v, rope, cache, meta.slot_mapping, q_norm, k_norm
            )
            out = self.backend.forward(q, k, v, cache, meta, self.scale, kv_stored=stored)
        return out.reshape(t, -1)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend)
        self.mlp: GatedMLP | SparseMoeBlock
        if cfg.moe is not None and index in cfg.moe.sparse_layers:
            self.mlp = SparseMoeBlock(cfg.moe, cfg.hidden_size)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,  # [T, E] input_layernorm(residual), done by the caller
        residual: torch.Tensor,  # [T, E] the residual stream before this layer
        next_norm: RMSNorm,  # the next layer's input norm, or the final norm
        rope: Any,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        ops: TorchOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(next_norm(residual'), residual') where residual' is the stream after this layer:
        each residual add is fused with the norm that reads it, and on the Triton path with
        the projection before it where the skinny GEMM runs that (o_proj and down:
        ops.linear_add_rms_norm); a sparse MLP's, on the Triton decode path, with the
        experts' combine too (SparseMoeBlock.add_norm), and the add + norm before it with
        the router's linear (SparseMoeBlock.decode_layer)."""
        if not isinstance(self.mlp, SparseMoeBlock):
            a = self.self_attn.attend(h, rope, cache, meta, ops)
            post = self.post_attention_layernorm
            residual, h = ops.linear_add_rms_norm(self.self_attn.o_proj, a, post, residual)
            residual, h = self.mlp.add_norm(h, residual, next_norm, ops)
            return h, residual
        a = self.self_attn(h, rope, cache, meta, ops)
        whole = self.mlp.decode_layer(a, residual, self.post_attention_layernorm, next_norm, ops)
        if whole is not None:
            residual, h = whole
            return h, residual
        residual, h = ops.add_rms_norm(self.post_attention_layernorm, a, residual)
        fused = self.mlp.add_norm(h, residual, next_norm, ops)
        if fused is None:
            fused = ops.add_rms_norm(next_norm, self.mlp(h, ops), residual)
        residual, h = fused
        return h, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope)


class LlamaForCausalLM(PagedCausalLM):
    """The Llama family's forward (model/causal_lm.py) with RoPE by the runner's ops."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__(cfg, LlamaModel(cfg, backend or TorchPagedAttention()))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return self.ops.rope(self.model.rotary_emb, positions, dtype)

    def fuse_projections(self) -> None:
        """After loading: q/k/v → qkv_proj and gate/up → gate_up_proj in every layer."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
