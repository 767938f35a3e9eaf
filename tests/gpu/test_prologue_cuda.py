"""The fused attention prologue (q/k norm + RoPE + KV store, kernels/triton_prologue.py) on
the GPU in bf16, which the CPU interpreter cannot check: Qwen3-30B-A3B's and Llama-3-8B's
head shapes, decode and prefill, against the torch reference (TorchOps + write_kv) and
against the unfused Triton kernels it replaces."""

from __future__ import annotations

import pytest
import torch

from ds4pool.model.attention import write_kv
from ds4pool.model.config import RopeConfig
from ds4pool.model.layers import RMSNorm, RotaryEmbedding
from ds4pool.model.ops import TorchOps, TritonOps

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("tokens", [1, 64, 1000])
@pytest.mark.parametrize(("heads", "kv_heads", "norms"), [(32, 4, True), (32, 8, False)])
def test_fused_prologue_matches_the_reference_in_bf16(
    tokens: int, heads: int, kv_heads: int, norms: bool
) -> None:
    d, bs, blocks, dt = 128, 16, 80, torch.bfloat16
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    rot = RotaryEmbedding(d, RopeConfig(theta=1e6)).to(CUDA)
    q_norm, k_norm = RMSNorm(d, 1e-6).to(CUDA, dt), RMSNorm(d, 1e-6).to(CUDA, dt)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=gen)
        k_norm.weight.uniform_(0.5, 1.5, generator=gen)
    nq, nk = (q_norm, k_norm) if norms else (None, None)
    positions = torch.randint(0, 30000, (tokens,), device=CUDA, generator=gen)
    slots = torch.randperm(blocks * bs, device=CUDA, generator=gen)[:tokens]
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=CUDA, dtype=dt, generator=gen)

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = buf.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
        return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)

    def cache() -> torch.Tensor:
        return torch.zeros(2, blocks + 1, bs, kv_heads, d, device=CUDA, dtype=dt)

    ref, fast = TorchOps(), TritonOps()
    want_cache, (q, k, v) = cache(), views(qkv.clone())
    wq, wk, _ = ref.attention_prologue(
        q, k, v, ref.rope(rot, positions, dt), want_cache, slots, nq, nk
    )
    write_kv(want_cache, wk, v, slots)
    rope = fast.rope(rot, positions, dt)
    q, k, v = views(qkv.clone())
    if norms:
        q, k = fast.rms_norm(q_norm, q), fast.rms_norm(k_norm, k)
    uq, uk = TritonOps.rotary(fast, q, k, rope)
    got_cache, (q, k, v) = cache(), views(qkv.clone())
    gq, gk, stored = fast.attention_prologue(q, k, v, rope, got_cache, slots, nq, nk)
    torch.cuda.synchronize()
    assert stored
    # bf16: within a few ulps of the torch reference (cos/sin, norms round alike), and the
    # unfused Triton kernels' result but for the norm's summation order
    for got, want in ((gq, wq), (gk, wk), (got_cache, want_cache)):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(gq, uq, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(gk, uk, atol=1e-2, rtol=1e-2)
    assert torch.equal(got_cache.view(2, -1, kv_heads, d)[1, slots], v)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_combine_with_add_norm_equals_the_unfused_pair_in_bf16(tokens: int, split: int) -> None:
    """The MoE decode path's last launch with the layer's residual add and next RMSNorm
    (kernels/triton_moe_combine.py) at Qwen3-30B-A3B's hidden size, vs the plain combine and
    TritonOps.add_rms_norm: the same residual bit for bit, the same norm to a bf16 ulp."""
    from ds4pool.model.kernels.triton_moe_configs import DEFAULT, DecodeConfig, ProjTiles
    from ds4pool.model.kernels.triton_moe_decode import decode_experts
    from ds4pool.model.kernels.triton_moe_route import expert_groups
    from ds4pool.model.routers import route_softmax_topk

    dt, e, k, hidden, inter = torch.bfloat16, 128, 8, 2048, 768
    gen = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=CUDA, dtype=dt, generator=gen)
    gate_up = (torch.randn(e, 2 * inter, hidden, device=CUDA, generator=gen) * 0.02).to(dt)
    down = (torch.randn(e, hidden, inter, device=CUDA, generator=gen) * 0.02).to(dt)
    weights, ids = route_softmax_topk(torch.randn(tokens, e, device=CUDA, generator=gen), k, True)
    groups = expert_groups(ids, e)
    norm = RMSNorm(hidden, 1e-6).to(CUDA, dt)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    config = DecodeConfig(DEFAULT.gate_up, ProjTiles(32, 128, split))
    residual = torch.randn(tokens, hidden, device=CUDA, dtype=dt, generator=gen)
    plain = decode_experts(x, weights, ids, groups, gate_up, down, config=config)
    want_res, want_h = TritonOps().add_rms_norm(norm, plain, residual.clone())
    got_res = residual.clone()
    got_h = decode_experts(
        x, weights, ids, groups, gate_up, down, config=config, residual=got_res,
        norm_weight=norm.weight, eps=norm.eps,
    )  # fmt: skip
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got_h, want_h, atol=1e-2, rtol=1e-2)
