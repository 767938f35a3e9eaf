"""The Triton paged MLA decode kernel on a CUDA GPU against the torch MLA reference.

- the kernel at DeepSeek-V3's latent shape (R = 512, r = 64; 16 heads as deepseek-v3-small,
  128 as the full model: 8 head blocks), bf16, shuffled block tables, contexts that split into
  partitions by the backend's rule and ones that stay whole: rel error vs float64 < 1e-2, no
  worse than the bf16 torch reference's own x1.25; padding rows zero;
- one CUDA-graph capture replays new lengths and tables exactly as an eager launch;
- the tiny DeepSeek-V3 preset end to end, teacher-forced over 4 x 96 decode positions (one
  context past the 1,024-token short-row limit, so split-K runs): the triton-mla backend with
  graphs picks the torch-mla backend's greedy token at >= 99% of positions (where bf16 tracks
  fp32 that well; else it flips no more positions away from fp32 than torch-mla, 2% slack),
  and its logits drift from fp32 no more than torch-mla's (x1.25).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.attention_mla import TorchMLAAttention
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner
from tests.paged_cases import make_case, poison_unused_slots, rel_err

pytestmark = pytest.mark.cuda
tm = pytest.importorskip("ds4pool.model.kernels.triton_mla")
R, ROPE = 512, 64


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
              scale: float) -> torch.Tensor:  # fmt: skip
    """TorchMLAAttention's decode of the rows with context > 0, in the inputs' dtype."""
    rows = torch.nonzero(lens > 0).flatten()
    meta = AttentionMetadata(
        positions=rows, slot_mapping=rows, block_tables=tables.long(),
        context_lens=lens.long(), decode_rows=rows, decode_tokens=rows,
        max_decode_blocks=tables.shape[1], prefills=(), block_size=cache.shape[2],
    )  # fmt: skip
    return TorchMLAAttention._decode(q, cache, meta, scale, R)


def run(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
        scale: float, out: torch.Tensor) -> None:  # fmt: skip
    from ds4pool.model.attention_mla_triton import TritonMLAAttention

    backend = TritonMLAAttention()
    width = tables.shape[1] * cache.shape[1]
    tm.mla_decode(
        q, cache, tables, lens, scale, out,
        partition_size=backend.partition_size(q.shape[0], q.shape[1], width),
        short_context=backend.short_context,
    )  # fmt: skip


@pytest.mark.parametrize("heads", [16, 128])
def test_mla_decode_matches_the_torch_reference_in_bf16(heads: int) -> None:
    ctx = [1, 15, 17, 300, 1024, 1025, 2049, 4000, 0, 64, 3]
    case = make_case([1] * len(ctx), ctx, heads=heads, kv_heads=1, head_dim=R + ROPE,
                     block_size=16, dtype=torch.bfloat16, device="cuda", seed=heads)  # fmt: skip
    cache = case.cache[:1]
    q, scale = case.q * 0.5, (128 + ROPE) ** -0.5  # DeepSeek's qk_head_dim 192
    exact = reference(q.double(), cache.double(), case.block_tables, case.context_lens, scale)
    ref16 = reference(q, cache, case.block_tables, case.context_lens, scale)
    poison_unused_slots(case)
    out = torch.full((len(ctx), heads, R), float("nan"), dtype=torch.bfloat16, device="cuda")
    run(q, cache[0], case.block_tables, case.context_lens, scale, out)
    live = case.context_lens > 0
    assert torch.isfinite(out[live]).all() and (out[~live] == 0).all()
    err, ref_err = rel_err(out[live], exact.cpu()), rel_err(ref16, exact.cpu())
    assert err < 1e-2 and err <= 1.25 * ref_err + 1e-3, (err, ref_err)


def test_mla_decode_graph_replays_new_values() -> None:
    """Grid and scratch come from shapes only: one capture serves any lengths and tables."""
    ctx = [5, 400, 3000, 0, 2047, 31]
    first = make_case([1] * 6, ctx, heads=16, kv_heads=1, head_dim=R + ROPE, block_size=16,
                      dtype=torch.bfloat16, device="cuda", spare_blocks=200, seed=1)  # fmt: skip
    q, tables, lens = first.q.clone(), first.block_tables.clone(), first.context_lens.clone()
    cache, scale = first.cache[0], 0.07
    out = torch.empty((6, 16, R), dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        run(q, cache, tables, lens, scale, out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(7)
    for new_lens in ([3008, 0, 1, 17, 999, 64], [3, 3, 3, 3, 3, 3]):
        lens.copy_(torch.tensor(new_lens, dtype=lens.dtype))
        tables.copy_(torch.randint(0, cache.shape[0], tables.shape, generator=gen, device="cuda"))
        q.normal_(generator=gen)
        graph.replay()
        replayed = out.clone()
        step()
        torch.testing.assert_close(replayed, out, rtol=0, atol=0)
        live = lens > 0
        exact = reference(q.double(), cache[None].double(), tables, lens, scale)
        assert rel_err(replayed[live], exact.cpu()) < 1e-2


def test_deepseek_greedy_tokens_triton_mla_vs_torch_mla() -> None:
    """Teacher-forced with the tokens of the same weights in fp32 on the CPU reference (the
    upcast is exact), so one early flip cannot cascade; judged as
    tests/gpu/test_fast_path_cuda.py judges the dense path."""
    from tests.gpu.test_fast_path_cuda import agreement, decode_trace, worst_error

    loaded = load_model("random:deepseek-v3-tiny", torch.device("cuda"), torch.bfloat16)
    cpu = torch.device("cpu")
    model32 = copy.deepcopy(loaded.model).float().to(cpu)
    loaded32 = dataclasses.replace(loaded, model=model32, dtype=torch.float32, device=cpu)
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 5, 1300, 33)]
    steps = 96  # x 4 sequences = 384 decode positions

    def trace(ld: LoadedModel, backend: str, forced: list[list[int]] | None) -> tuple:
        r = ModelRunner(ld, num_blocks=512, backend=backend, cuda_graphs=backend == "triton")
        assert r.backend.name == f"{backend}-mla"
        assert (r.graphs is not None) == (backend == "triton")
        tokens, logits = decode_trace(r, prompts, forced, steps)
        return tokens, [x.cpu().float() for x in logits]

    truth_tokens, truth = trace(loaded32, "torch", None)
    del loaded32
    ref_tokens, ref = trace(loaded, "torch", truth_tokens)
    fast_tokens, fast = trace(loaded, "triton", truth_tokens)
    same, total = agreement(ref_tokens, fast_tokens)
    ref_fp32, _ = agreement(truth_tokens, ref_tokens)
    fast_fp32, _ = agreement(truth_tokens, fast_tokens)
    ref_err, fast_err = worst_error(truth, ref), worst_error(truth, fast)
    print(
        f"\ndeepseek-v3-tiny bf16, {total} positions: greedy triton-mla vs torch-mla {same}, "
        f"torch-mla vs fp32 {ref_fp32}, triton-mla vs fp32 {fast_fp32}; max rel |Δlogit| vs "
        f"fp32: torch-mla {ref_err:.2e}, triton-mla {fast_err:.2e}"
    )
    assert fast_err <= 1.25 * ref_err + 1e-3, (fast_err, ref_err)
    if ref_fp32 >= 0.99 * total:  # where bf16 itself tracks fp32: >= 99% identical tokens
        assert same >= 0.99 * total, (same, total)
    else:  # near-tied random logits that bf16 flips: no more flips than the reference
        assert fast_fp32 >= ref_fp32 - 0.02 * total, (fast_fp32, ref_fp32)
