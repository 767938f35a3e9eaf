"""The attention prologue inside the decode kernel (TritonOps.decode_attention →
TritonPagedAttention.forward_decode_prologue → paged_decode(prologue=...)) on the GPU, which
the CPU interpreter cannot check: compiled, bf16, pipelined K/V loads after the barrier.

- kernel level, against the prologue's own launch followed by the plain decode kernel, at
  Llama-3-8B's (32 / 8 heads, no norms) and Qwen3-30B-A3B's (32 / 4, q/k norms) head
  shapes, D 128, batch 1, 7 and 64 (a padding row in the batches > 1), contexts about 160
  (one piece) and 3000 (split-K), through the backend's own launch choice: the cache
  (the k and v stored) bit for bit; the attention within one bf16 rounding, and the same
  bits on a second run. Compiled, the two kernels round the rotated q differently in a few
  elements (the H200, session 23: 1.2e-4 to 7.8e-3 apart, about one bf16 step of the
  outputs, while the interpreter gives equal bits), so the attention is not compared bit
  for bit. The new token's slots hold a stale k (0) and v (100) before the call: a
  program that loaded its last tile before the new k and v were stored would be off by
  far more than a rounding;
- model level: greedy decode through CUDA graphs with the fused path on vs off gives the
  same tokens and logits within bf16 rounding, on the demo Llama and a tiny Qwen3-MoE preset.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from ds4pool.model.attention import build_metadata
from ds4pool.model.config import RopeConfig
from ds4pool.model.layers import RMSNorm, RotaryEmbedding
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.ops import TritonOps
from ds4pool.model.runner import ModelRunner
from tests.gpu.test_fast_path_cuda import decode_trace

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")
CUDA = torch.device("cuda")


@pytest.mark.parametrize("context", [160, 3000])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize(("heads", "kv_heads", "norms"), [(32, 8, False), (32, 4, True)])
def test_fused_decode_equals_prologue_then_decode_in_bf16(
    batch: int, context: int, heads: int, kv_heads: int, norms: bool
) -> None:
    from ds4pool.model.attention_triton import TritonPagedAttention

    d, bs, dt = 128, 16, torch.bfloat16
    gen = torch.Generator(device=CUDA).manual_seed(batch * context)
    rot = RotaryEmbedding(d, RopeConfig(theta=1e6)).to(CUDA)
    q_norm, k_norm = RMSNorm(d, 1e-6).to(CUDA, dt), RMSNorm(d, 1e-6).to(CUDA, dt)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=gen)
        k_norm.weight.uniform_(0.5, 1.5, generator=gen)
    nq, nk = (q_norm, k_norm) if norms else (None, None)
    # ragged contexts around `context`; the last row of a batch > 1 pads (context 0)
    lens = [max(1, context - (37 * i) % 150) for i in range(batch)]
    width = -(-max(lens) // bs)
    blocks = batch * width
    perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(batch)).tolist()
    tables = [perm[i * width : (i + 1) * width] for i in range(batch)]
    meta = build_metadata([1] * batch, lens, tables, bs, CUDA, index_dtype=torch.int32)
    if batch > 1:
        meta.context_lens[-1] = 0
        meta.slot_mapping[-1] = blocks * bs  # the scratch block (the last)
    cache = torch.randn(2, blocks + 1, bs, kv_heads, d, device=CUDA, generator=gen).to(dt)
    flat = cache.view(2, -1, kv_heads, d)  # [2, slots, H_kv, D]
    flat[0, meta.slot_mapping.long()] = 0.0  # stale k, v where this step's k, v go: a key
    flat[1, meta.slot_mapping.long()] = 100.0  # of weight ~1 / context, far off if read
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, device=CUDA, generator=gen).to(dt)

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = buf.split((heads * d, kv_heads * d, kv_heads * d), dim=-1)
        return q.view(batch, heads, d), k.view(batch, kv_heads, d), v.view(batch, kv_heads, d)

    backend, ops = TritonPagedAttention(), TritonOps(decode_prologue=True)
    rope = ops.rope(rot, meta.positions, dt)
    want_cache, (q, k, v) = cache.clone(), views(qkv.clone())
    q, k, stored = ops.attention_prologue(q, k, v, rope, want_cache, meta.slot_mapping, nq, nk)
    assert stored
    want = backend.forward(q, k, v, want_cache, meta, d**-0.5, kv_stored=True)
    runs = []
    for _ in range(2):
        got_cache, (q, k, v) = cache.clone(), views(qkv.clone())
        got = ops.decode_attention(backend, q, k, v, rope, got_cache, meta, d**-0.5, nq, nk)
        torch.cuda.synchronize()
        assert got is not None, "the fused path did not take this step"
        assert torch.equal(got_cache, want_cache), "k/v stores differ"
        runs.append(got)
    got = runs[0]
    assert torch.equal(runs[1], got), "two runs of the fused kernel differ"
    real = meta.context_lens > 0
    assert torch.isfinite(got).all() and (got[~real] == 0).all()
    # one bf16 rounding of the output (8 significant bits), a stale slot read is >> that
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2**-9)


@pytest.fixture(scope="module", params=["demo", "random:qwen3-moe-70m"])
def loaded(request: pytest.FixtureRequest, demo_dir: Path) -> LoadedModel:
    spec = str(demo_dir) if request.param == "demo" else request.param
    got = load_model(spec, CUDA, torch.float32)
    return dataclasses.replace(
        got, model=copy.deepcopy(got.model).to(torch.bfloat16), dtype=torch.bfloat16
    )


def test_graphed_greedy_decode_is_the_same_with_the_fused_prologue_on_and_off(
    loaded: LoadedModel,
) -> None:
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    # 5 sequences: a graph bucket of 8 (3 padding rows), one long context (split-K)
    prompts = [
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (20, 1100, 7, 64, 300)
    ]

    def trace(fused: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        r = ModelRunner(loaded, num_blocks=1024, backend="triton", cuda_graphs=True)
        assert isinstance(r.model.ops, TritonOps)
        r.model.ops.decode_prologue = fused
        calls = 0
        entry = r.backend.forward_decode_prologue

        def counted(*args: object) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return entry(*args)

        r.backend.forward_decode_prologue = counted
        out = decode_trace(r, prompts, None, 24)
        assert r.graphs is not None and r.graphs.captures >= 1
        assert (calls > 0) == fused, calls  # the fused path ran (in the captures) iff on
        return out

    off_tokens, off_logits = trace(False)
    on_tokens, on_logits = trace(True)
    assert on_tokens == off_tokens
    for a, b in zip(on_logits, off_logits):  # the H200: at most 0.0625 apart (session 23)
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-6, atol=0.125)
