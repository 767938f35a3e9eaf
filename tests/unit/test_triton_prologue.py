"""The fused attention prologue (model/kernels/triton_prologue.py: q/k norm + RoPE + KV store
in one launch, through TritonOps.attention_prologue) against the torch reference (TorchOps:
RMSNorm modules, apply_rotary, write_kv) under Triton's CPU interpreter, in a child process
(tests/interpreter.py). The q, k, v given are strided views of one fused qkv output, as the
model passes them; the cache starts as NaN so a missed or misplaced store shows.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.interpreter import interpreter_results, print_cases

# case → (tokens, heads, kv heads, head_dim, q/k norms?, dtype, rope kind): decode (one
# token) and prefill chunks, head_dim not a power of two (masked tail of the half), odd
# head counts, more than one 16-head block of q, yarn's attention factor, fp16 (not bf16:
# this interpreter turns bf16 loads into garbage, the existing fused kernels' too; the GPU
# test tests/gpu/test_fast_path_cuda.py covers bf16)
CASES: dict[str, tuple[int, int, int, int, bool, str, str]] = {
    "qwen3_decode_fp32": (1, 8, 2, 32, True, "float32", "default"),
    "qwen3_prefill_fp32": (9, 20, 4, 24, True, "float32", "default"),
    "llama_prefill_fp32": (7, 5, 3, 24, False, "float32", "llama3"),
    "llama_decode_yarn_fp32": (3, 4, 2, 16, False, "float32", "yarn"),
    "qwen3_prefill_fp16": (6, 6, 2, 32, True, "float16", "default"),
}
BLOCK_SIZE, NUM_BLOCKS = 4, 6


def _rope(kind: str) -> Any:
    from ds4pool.model.config import RopeConfig

    if kind == "llama3":
        return RopeConfig(theta=500000.0, kind="llama3", factor=8.0, original_max_position=64)
    if kind == "yarn":
        return RopeConfig(kind="yarn", factor=4.0, original_max_position=64)
    return RopeConfig()


def _case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.attention import write_kv
    from ds4pool.model.layers import RMSNorm, RotaryEmbedding
    from ds4pool.model.ops import TorchOps, TritonOps

    t, h, hkv, d, norms, dtype_name, rope_kind = CASES[name]
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(len(name))
    rot = RotaryEmbedding(d, _rope(rope_kind))
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5, generator=gen)
        k_norm.weight.uniform_(0.5, 1.5, generator=gen)
    q_norm, k_norm = q_norm.to(dtype), k_norm.to(dtype)
    # positions of a prefill chunk at the end of a context, or scattered decode rows
    positions = torch.arange(13 - t, 13) if t > 3 else torch.tensor([0, 5, 4095][:t])
    # slots over several blocks, partial blocks, and the scratch block (the last one)
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:t]
    slots[-1] = NUM_BLOCKS * BLOCK_SIZE + 1  # a padded row's write into the scratch block
    qkv = torch.randn(t, (h + 2 * hkv) * d, generator=gen).to(dtype)

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = buf.split((h * d, hkv * d, hkv * d), dim=-1)
        return q.view(t, h, d), k.view(t, hkv, d), v.reshape(t, hkv, d)

    def cache() -> torch.Tensor:
        return torch.full((2, NUM_BLOCKS + 1, BLOCK_SIZE, hkv, d), float("nan"), dtype=dtype)

    nq, nk = (q_norm, k_norm) if norms else (None, None)
    ref, fast = TorchOps(), TritonOps()
    want_cache = cache()
    q, k, v = views(qkv.clone())
    want_q, want_k, stored = ref.attention_prologue(
        q, k, v, ref.rope(rot, positions, dtype), want_cache, slots, nq, nk
    )
    assert not stored
    write_kv(want_cache, want_k, v, slots)
    # the unfused Triton kernels (norm, rotary, store_kv): the fused one must equal them
    unfused_cache = cache()
    q, k, v = views(qkv.clone())
    rope = fast.rope(rot, positions, dtype)
    if norms:
        q, k = fast.rms_norm(q_norm, q), fast.rms_norm(k_norm, k)
    uq, uk = TritonOps.rotary(fast, q, k, rope)
    fast._k.store_kv(unfused_cache, uk, v, slots)

    got_cache = cache()
    buf = qkv.clone()
    q, k, v = views(buf)
    got_q, got_k, stored = fast.attention_prologue(q, k, v, rope, got_cache, slots, nq, nk)
    in_place = got_q.data_ptr() == buf.data_ptr() and torch.equal(views(buf)[0], got_q)
    flat_got = got_cache.view(2, -1, hkv, d)
    untouched = torch.ones(flat_got.shape[1], dtype=torch.bool)
    untouched[slots] = False

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().double() - b.detach().double()).abs().max())

    flat_want = want_cache.view(2, -1, hkv, d)
    return {
        "name": name,
        "stored": stored,
        "in_place": in_place,
        "q_err": err(got_q, want_q),
        "k_err": err(got_k, want_k),
        "cache_err": err(flat_got[:, slots], flat_want[:, slots]),
        "v_exact": torch.equal(flat_got[1, slots], v),
        "others_untouched": bool(flat_got[:, untouched].isnan().all()),
        # the norm's sum of squares runs over two halves here, one row there: a last-bit
        # difference in fp32 at most
        "unfused_err": max(
            err(got_q, uq),
            err(got_k, uk),
            err(flat_got[:, slots], unfused_cache.view(2, -1, hkv, d)[:, slots]),
        ),
        "tolerance": 1e-5 if dtype == torch.float32 else 2e-2,
    }


# model case → architecture: a tiny decoder through a prompt chunk and two decode steps
# with TritonOps (the fused prologue; the backend skips its store) vs TorchOps
# (Qwen3-MoE: also the experts' combine + residual add + norm in one launch, the decode
# kernels vs the reference loop)
MODEL_CASES: dict[str, str] = {
    "qwen3_model": "Qwen3ForCausalLM",
    "llama_model": "LlamaForCausalLM",
    "qwen3_moe_model": "Qwen3MoeForCausalLM",
}
MOE_FIELDS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _model_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.attention import TorchPagedAttention, build_metadata
    from ds4pool.model.config import ModelConfig
    from ds4pool.model.llama import LlamaForCausalLM
    from ds4pool.model.moe import SparseMoeBlock
    from ds4pool.model.ops import TorchOps, TritonOps

    cfg = ModelConfig.from_hf(
        {
            "architectures": [MODEL_CASES[name]],
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            **(MOE_FIELDS if "Moe" in MODEL_CASES[name] else {}),
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, TorchPagedAttention(cpu_kernels=False))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.fuse_projections()
    table = [2, 0, 3]  # blocks of 4: a 9-token context ends in a partial block
    steps = [(list(range(1, 8)), 7), ([9], 8), ([11], 9)]  # (new tokens, context after)

    def run(ops: TorchOps) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model.set_attention_backend(TorchPagedAttention(cpu_kernels=False), ops)
        for m in model.modules():
            if isinstance(m, SparseMoeBlock):  # the decode kernels where the ops are Triton's
                m.impl = "decode" if ops.name == "triton" else "loop"
        caches = [torch.zeros(2, 5, 4, 2, 16) for _ in range(2)]
        outs = []
        for ids, ctx in steps:
            meta = build_metadata([len(ids)], [ctx], [table], 4, torch.device("cpu"))
            with torch.no_grad():
                outs.append(model(torch.tensor(ids), caches, meta))
        return outs, caches

    want, want_caches = run(TorchOps())
    got, got_caches = run(TritonOps())
    return {
        "name": name,
        "hidden_err": max(float((a - b).abs().max()) for a, b in zip(got, want)),
        "cache_err": max(float((a - b).abs().max()) for a, b in zip(got_caches, want_caches)),
    }


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_model_with_fused_prologue_matches_torch_ops(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["hidden_err"] < 1e-4, r
    assert r["cache_err"] < 1e-5, r


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=400)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_prologue_matches_the_torch_reference(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["stored"], "TritonOps must report k and v as stored (the backend skips its store)"
    assert r["in_place"], "q must be rotated in place in the qkv output"
    for key in ("q_err", "k_err", "cache_err"):
        assert r[key] < r["tolerance"], (key, r)
    assert r["v_exact"], "v must reach the cache unchanged"
    assert r["others_untouched"], "the store wrote outside this step's slots"
    assert r["unfused_err"] < r["tolerance"] / 10, ("must round as the unfused kernels do", r)


if __name__ == "__main__":
    print_cases(CASES, _case)
    print_cases(MODEL_CASES, _model_case)
