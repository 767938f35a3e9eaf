"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Parameter names are Hugging Face's (DeepseekV3Attention), so loading is a plain mapping.
Per token, `kv_a_proj_with_mqa` makes the latent c [R] (then `kv_a_layernorm`) and one
rotary key k_rot [r] shared by all heads; the cache stores [c | rotated k_rot] (R + r values,
KVLayout kind "mla"), never per-head K/V. `kv_b_proj` [H·(dn + dv), R] would lift c to
per-head k_nope [dn] and v [dv]; instead its two halves are absorbed:

    W_UK [H, dn, R]  into the query:   q_abs[h] = q_nope[h] · W_UK[h]         [R]
    W_UV [H, dv, R]  after attention:  out[h]   = W_UV[h] · Σ_j p[h, j] c_j    [dv]

so attention (ds4pool/model/attention_mla.py) runs over the latent itself: for decode tokens
and short prompt chunks, where reading the latent once beats lifting the whole context. A
prompt chunk of Q queries over C keys costs per key, absorbed, Q·(2R + r) multiply-adds; lifted
to per-head K/V, Q·(dn + r + dv) plus R·(dn + dv) for the lift. So chunks longer than
R·(dn + dv) / (2R − dn − dv) queries (170 for DeepSeek-V3) lift their context with kv_b_proj
and attend per head as transformers does (SDPA over [H, C, dn + r] keys, [H, C, dv] values):
far less work and no [H, Q, C] score tensor of the one-head form on kernels that lack it. Both
forms give transformers' logits (exact in real arithmetic; fp32 within ~1e-6).

Shapes: T = tokens in the step, H = heads, dn = qk_nope_head_dim, r = qk_rope_head_dim,
dv = v_head_dim, R = kv_lora_rank, E = hidden size.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.attention_mla import MLABackend, causal_mask
from ds4pool.model.config import ModelConfig
from ds4pool.model.layers import RMSNorm, apply_rotary, apply_rotary_interleaved, yarn_mscale


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times yarn's mscale(factor, mscale_all_dim) squared (the
    magnitude the longer context takes away from q·k, as DeepSeek-V3 and transformers)."""
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim**-0.5
    rope = cfg.rope
    if rope.kind == "yarn" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: MLABackend) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        e, h = cfg.hidden_size, cfg.num_heads
        bias = cfg.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(e, h * mla.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(e, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)  # transformers' default eps
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(e, mla.latent_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, h * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * mla.v_head_dim, e, bias=bias)
        self.mla, self.num_heads = mla, h
        self.scale = softmax_scale(cfg)
        self.rotate = apply_rotary_interleaved if mla.rope_interleave else apply_rotary
        self.backend = backend
        # prompt chunks of more queries than this lift their context (module docstring)
        r, lifted = mla.kv_lora_rank, mla.qk_nope_head_dim + mla.v_head_dim
        self.lift_min_queries = r * lifted / (2 * r - lifted) if 2 * r > lifted else math.inf

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, R] and W_UV [H, dv, R]: views of kv_b_proj's weight, no copy."""
        m = self.mla
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        rope: Any,  # cos, sin [T, 1, r]
        cache: torch.Tensor,  # [1, N + 1, bs, 1, R + r]
        meta: AttentionMetadata,
        ops: Any,
    ) -> torch.Tensor:  # [T, E]
        m, t, h = self.mla, x.shape[0], self.num_heads
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(ops.rms_norm(self.q_a_layernorm, self.q_a_proj(x)))
        q_nope, q_rot = q.view(t, h, m.qk_head_dim).split(
            (m.qk_nope_head_dim, m.qk_rope_head_dim), dim=-1
        )  # [T, H, dn], [T, H, r]
        c, k_rot = self.kv_a_proj_with_mqa(x).split((m.kv_lora_rank, m.qk_rope_head_dim), dim=-1)
        c = ops.rms_norm(self.kv_a_layernorm, c)  # [T, R]
        cos, sin = rope
        q_rot = self.rotate(q_rot, cos, sin)
        k_rot = self.rotate(k_rot[:, None, :], cos, sin)  # [T, 1, r]
        latent = torch.cat((c[:, None, :], k_rot), dim=-1)  # [T, 1, R + r]

        w_uk, w_uv = self.absorbed()
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, R]
        q_full = torch.cat((q_abs, q_rot), dim=-1)  # [T, H, R + r]
        lifted = [p for p in meta.prefills if p.token_end - p.token_start > self.lift_min_queries]
        absorbed_meta = meta
        if lifted:
            absorbed_meta = replace(
                meta, prefills=tuple(p for p in meta.prefills if p not in lifted)
            )
        o = self.backend.forward(q_full, latent, cache, absorbed_meta, self.scale, m.kv_lora_rank)
        o = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, dv]
        for p in lifted:  # their rows of `o` were left unset by the backend
            o[p.token_start : p.token_end] = self._lifted_prefill(
                q_nope[p.token_start : p.token_end],
                q_rot[p.token_start : p.token_end],
                self.backend.context(cache, meta, p),
                p.context_len,
            )
        return self.o_proj(o.reshape(t, h * m.v_head_dim))

    def _lifted_prefill(
        self,
        q_nope: torch.Tensor,  # [Q, H, dn]
        q_rot: torch.Tensor,  # [Q, H, r]
        context: torch.Tensor,  # [C, R + r] the chunk's whole context, itself included
        context_len: int,
    ) -> torch.Tensor:  # [Q, H, dv]
        m, h = self.mla, self.num_heads
        c, k_rot = context.split((m.kv_lora_rank, m.qk_rope_head_dim), dim=-1)
        kv = self.kv_b_proj(c).view(-1, h, m.qk_nope_head_dim + m.v_head_dim)  # [C, H, dn + dv]
        k_nope, v = kv.split((m.qk_nope_head_dim, m.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_rot[:, None, :].expand(-1, h, -1)), dim=-1)  # [C, H, dn + r]
        q = torch.cat((q_nope, q_rot), dim=-1)  # [Q, H, dn + r]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, H, Q, dn + r]
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],  # [1, H, C, dv]
            attn_mask=causal_mask(q.shape[0], context_len, q.device),
            is_causal=q.shape[0] == context_len,
            scale=self.scale,
        )  # [1, H, Q, dv]
        return out[0].transpose(0, 1)
