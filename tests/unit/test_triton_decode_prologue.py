"""The attention prologue inside the decode kernel (paged_decode(prologue=...): q/k norm,
RoPE and the k/v store done by the decode programs, kernels/_decode_kernels.py) against the
prologue's own launch followed by the plain decode kernel (norm_rope_store + paged_decode),
bit for bit, under Triton's CPU interpreter in a child process (tests/interpreter.py): the
attention output, the whole cache after the call (k and v at the slots, padding rows' at the
scratch slot, nothing else written) and the qkv buffer (the fused path stores no q or k).
Also TritonOps.decode_attention through a tiny model's decode steps, fused on vs off.
fp32 and fp16 (this interpreter's bf16 is broken; tests/gpu/test_decode_prologue_cuda.py
runs bf16 compiled).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from tests.interpreter import interpreter_results, print_cases


@dataclass(frozen=True)
class Case:
    context_lens: list[int]  # 0: a padding row (slot: the scratch block's)
    heads: int
    kv_heads: int
    head_dim: int
    norms: bool  # Qwen3's q_norm / k_norm
    dtype: str = "float32"
    partition_size: int = 512  # > the table: one partition
    num_partitions: int | None = None
    short_context: int = 0
    window: int | None = None
    factor: float = 1.0  # yarn's attention factor


BLOCK_SIZE, BLOCK_N = 8, 16
CASES: dict[str, Case] = {
    # one partition (the program owns its row), G = 4, D = 128
    "g4_d128_norm_one_piece": Case([5, 0, 37], 8, 2, 128, True),
    # split rows (partitions of 32: the last partition stores), G = 8, a padding row
    "g8_d64_split_fp16": Case([70, 3, 0, 41], 8, 1, 64, False, "float16", partition_size=32),
    "g8_d64_norm_split": Case([50, 0, 33], 8, 1, 64, True, partition_size=32),
    # G = 1, a fixed number of pieces per row (the owner found at run time)
    "g1_d32_norm_fixed_p": Case([1, 40, 0, 90], 2, 2, 32, True, num_partitions=3),
    # short rows whole beside a split long row, a window, yarn's factor
    "g4_d32_short_window_fp16": Case(
        [100, 20, 0],
        8,
        2,
        32,
        True,
        "float16",
        partition_size=32,
        short_context=64,
        window=24,
        factor=1.25,
    ),
}


def _case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.kernels import triton_attention as ta
    from ds4pool.model.kernels.triton_prologue import DecodePrologue, norm_rope_store

    c = CASES[name]
    dtype = getattr(torch, c.dtype)
    gen = torch.Generator().manual_seed(len(name))
    b, h, hkv, d = len(c.context_lens), c.heads, c.kv_heads, c.head_dim
    max_blocks = -(-max(c.context_lens) // BLOCK_SIZE)
    n_blocks = b * max_blocks  # + the scratch block, the last
    cache = torch.randn(2, n_blocks + 1, BLOCK_SIZE, hkv, d, generator=gen).to(dtype)
    tables = torch.randperm(n_blocks, generator=gen).view(b, max_blocks).to(torch.int32)
    lens = torch.tensor(c.context_lens, dtype=torch.int32)
    positions = (lens.long() - 1).clamp(min=0)
    blocks = tables.long().gather(1, (positions // BLOCK_SIZE)[:, None])[:, 0]
    slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
    slots[lens == 0] = n_blocks * BLOCK_SIZE  # padding rows write the scratch block
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    qw = torch.rand(d, generator=gen).add(0.5).to(dtype) if c.norms else None
    kw = torch.rand(d, generator=gen).add(0.5).to(dtype) if c.norms else None
    eps = 1e-6 if c.norms else 0.0
    qkv = torch.randn(b, (h + 2 * hkv) * d, generator=gen).to(dtype)

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = buf.split((h * d, hkv * d, hkv * d), dim=-1)
        return q.view(b, h, d), k.view(b, hkv, d), v.reshape(b, hkv, d)

    def decode(q: torch.Tensor, kv: torch.Tensor, prologue: Any = None) -> torch.Tensor:
        out = torch.full((b, h, d), float("nan"), dtype=dtype)
        ta.paged_decode(
            q, kv[0], kv[1], tables, lens, d**-0.5, out, sliding_window=c.window,
            partition_size=c.partition_size, num_partitions=c.num_partitions,
            launch=ta.DecodeLaunch(block_n=BLOCK_N), short_context=c.short_context,
            prologue=prologue,
        )  # fmt: skip
        return out

    want_cache, want_buf = cache.clone(), qkv.clone()
    q, k, v = views(want_buf)
    norm_rope_store(q, k, v, want_cache, positions, slots, inv_freq, qw, kw, eps, c.factor)
    want = decode(q, want_cache)

    got_cache, got_buf = cache.clone(), qkv.clone()
    q, k, v = views(got_buf)
    got = decode(q, got_cache, DecodePrologue(k, v, positions, slots, inv_freq, qw, kw, eps,
                                              c.factor))  # fmt: skip
    real = lens > 0
    return {
        "name": name,
        "out_equal": torch.equal(got, want),
        "finite": bool(torch.isfinite(got).all()),
        "padding_zero": bool((got[~real] == 0).all()),
        "cache_equal": torch.equal(got_cache, want_cache),
        "qkv_untouched": torch.equal(got_buf, qkv),
        "stored_somewhere": not torch.equal(got_cache, cache),
    }


# a tiny decoder (2 layers, 4 heads / 2 kv, D 16) through decode steps of 2 rows and a
# padding row, TritonOps with the fused decode on vs off, TritonPagedAttention built
# without a GPU (its SM count set by hand)
MODEL_CASES = {"qwen3_model_decode": "Qwen3ForCausalLM", "llama_model_decode": "LlamaForCausalLM"}


def _model_case(name: str) -> dict[str, Any]:
    import torch

    from ds4pool.model.attention import build_metadata
    from ds4pool.model.attention_triton import TritonPagedAttention
    from ds4pool.model.config import ModelConfig
    from ds4pool.model.kernels import triton_attention, triton_decode_configs, triton_fused
    from ds4pool.model.llama import LlamaForCausalLM
    from ds4pool.model.ops import TritonOps

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
        }
    )
    backend = object.__new__(TritonPagedAttention)  # __init__ asks CUDA for the SM count
    backend._k, backend._store_kv = triton_attention, triton_fused.store_kv
    backend.decode_table, backend._sms = triton_decode_configs.DECODE_TABLE, 132
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, backend)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.fuse_projections()
    tables = [[2, 0, 3], [1, 4, 5], [0, 0, 0]]  # the last: a padding row (context 0)
    steps = [([9, 3, 0], [8, 10, 0]), ([11, 5, 0], [9, 11, 0])]  # (tokens, contexts after)

    def run(fused: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        ops = TritonOps(decode_prologue=fused)
        calls = 0
        entry = backend.forward_decode_prologue

        def counted(*args: Any) -> torch.Tensor:
            nonlocal calls
            calls += 1
            return entry(*args)

        backend.forward_decode_prologue = counted  # type: ignore[method-assign]
        model.set_attention_backend(backend, ops)
        gen = torch.Generator().manual_seed(1)
        caches = [torch.randn(2, 7, 4, 2, 16, generator=gen) for _ in range(2)]
        outs = []
        for ids, ctx in steps:
            meta = build_metadata(
                [1, 1, 1], [max(n, 1) for n in ctx], tables, 4, torch.device("cpu"),
                index_dtype=torch.int32,
            )  # fmt: skip
            # the padding row as a graph bucket pads it: context 0, the scratch slot
            meta.context_lens[2] = 0
            meta.slot_mapping[2] = 6 * 4
            with torch.no_grad():
                outs.append(model(torch.tensor(ids), caches, meta))
        del backend.forward_decode_prologue
        return outs, caches, calls

    want, want_caches, off_calls = run(False)
    got, got_caches, on_calls = run(True)
    return {
        "name": name,
        "hidden_equal": all(torch.equal(a, b) for a, b in zip(got, want)),
        "cache_equal": all(torch.equal(a, b) for a, b in zip(got_caches, want_caches)),
        "fused_calls": on_calls,
        "unfused_calls": off_calls,
    }


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_equals_prologue_then_decode(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["finite"] and r["padding_zero"], r
    assert r["out_equal"], ("attention differs from prologue + decode", r)
    assert r["stored_somewhere"] and r["cache_equal"], ("k/v stores differ", r)
    assert r["qkv_untouched"], "the fused path must not write q or k back"


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_model_decode_steps_fused_on_equal_off(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["fused_calls"] == 2 * 2 and r["unfused_calls"] == 0, r  # 2 steps x 2 layers
    assert r["hidden_equal"] and r["cache_equal"], r


def test_a_head_dim_not_a_power_of_two_is_refused() -> None:
    """The kernel joins two power-of-two halves into its q tile: D = 24 (halves of 12) is
    refused by the launch (TritonOps.decode_attention falls back to the prologue first)."""
    torch = pytest.importorskip("torch")
    tp = pytest.importorskip("ds4pool.model.kernels.triton_prologue")
    k = torch.zeros(1, 2, 24)
    pro = tp.DecodePrologue(k, k, torch.zeros(1), torch.zeros(1), torch.zeros(12))
    cache = torch.zeros(2, 3, 4, 2, 24)
    with pytest.raises(AssertionError, match="power-of-two"):
        pro.launch_args(cache[0], cache[1])


if __name__ == "__main__":
    print_cases(CASES, _case)
    print_cases(MODEL_CASES, _model_case)
