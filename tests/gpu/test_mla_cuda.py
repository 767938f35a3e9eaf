"""The Triton paged MLA decode kernel on a CUDA GPU against the torch MLA reference.

- the kernel at DeepSeek-V3's latent shape (R = 512, r = 64; 16 heads as deepseek-v3-small,
  128 as the full model: 8 head blocks), bf16, shuffled block tables, contexts that split into
  partitions by the backend's rule and ones that stay whole: rel error vs float64 < 1e-2, no
  worse than the bf16 torch reference's own x1.25; padding rows zero;
- one CUDA-graph capture replays new lengths and tables exactly as an eager launch;
- the tiny DeepSeek-V3 preset end to end, teacher-forced over 4 x 96 decode positions (one
  context past the 1,024-token short-row limit, so split-K runs): the triton-mla backend with
  graphs picks the torch-mla backend's greedy token at >= 99% of positions.
"""

from __future__ import annotations

import pytest
import torch

from ds4pool.model.attention import AttentionMetadata
from ds4pool.model.attention_mla import TorchMLAAttention
from ds4pool.model.loader import load_model
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
        short_context=backend._short,
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
    assert err < 1e-2 and err <= 1.25 * ref_err + 1e-4, (err, ref_err)


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
    from tests.gpu.test_fast_path_cuda import agreement, decode_trace, worst_error

    loaded = load_model("random:deepseek-v3-tiny", torch.device("cuda"), torch.bfloat16)
    vocab = loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 5, 1300, 33)]
    steps = 96  # x 4 sequences = 384 decode positions
    ref = ModelRunner(loaded, num_blocks=512, backend="torch", cuda_graphs=False)
    assert ref.backend.name == "torch-mla"
    ref_tokens, ref_logits = decode_trace(ref, prompts, None, steps)
    del ref
    fast = ModelRunner(loaded, num_blocks=512, backend="triton", cuda_graphs=True)
    assert fast.backend.name == "triton-mla" and fast.graphs is not None
    fast_tokens, fast_logits = decode_trace(fast, prompts, ref_tokens, steps)
    assert fast.graphs.captures > 0
    same, total = agreement(ref_tokens, fast_tokens)
    err = worst_error(ref_logits, fast_logits)
    print(f"\ndeepseek-v3-tiny bf16: triton-mla vs torch-mla greedy {same}/{total}, "
          f"max rel |Δlogit| {err:.2e}")  # fmt: skip
    assert same >= 0.99 * total, (same, total)
    assert err < 5e-2, err
