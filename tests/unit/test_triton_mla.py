"""The Triton paged MLA decode kernel under Triton's CPU interpreter, against the torch
reference (TorchMLAAttention) run in float64 over the same paged latent cache.

As test_triton_attention.py: TRITON_INTERPRET=1 must be set before the kernels are decorated,
so the cases run in one child interpreter (this file as a script), one JSON line each. Kernel
cases: shuffled block tables, head blocks (and padded heads), split-K with the dense reduce,
short rows that must equal their solo launch, unused cache slots poisoned with NaN. The model
case decodes the tiny DeepSeek-V3 with TritonMLAAttention (decode rows on the kernel, prompt
chunks on the reference, mixed steps) against the torch backend: fp32 logits and greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.interpreter import interpreter_results, print_cases


@dataclass(frozen=True)
class Case:
    context_lens: list[int]
    heads: int = 8
    rank: int = 64  # kv_lora_rank R (the values)
    rope: int = 16  # qk_rope_head_dim r
    block_size: int = 16
    block_n: int = 16
    block_h: int = 16
    partition_size: int = 1024
    short_context: int = 0
    dtype: str = "float32"  # float16 too; the interpreter's bf16 tl.dot is broken (triton 3.9)

    @property
    def tolerance(self) -> float:
        return 1e-5 if self.dtype == "float32" else 2e-3  # fp16: P is rounded before P·c


CASES: dict[str, Case] = {
    # P = 1: the kernel writes the output itself, zeros for the context-0 padding row
    "direct": Case([1, 17, 40, 0, 100]),
    # P = ceil(7 blocks * 16 / 32) = 4 partitions, the dense reduce combines them
    "splitk": Case([1, 17, 40, 0, 100], partition_size=32),
    # 19 partitions: more than the reduce's chunk of 16
    "splitk_reduce_chunks": Case([300, 2, 161], heads=4, partition_size=16),
    # 20 heads in blocks of 16 (the second padded), DeepSeek-like ratios, R and r not powers
    # of two (masked columns), blocks of 8 tokens under 32-key tiles
    "head_blocks_masked_dims": Case(
        [5, 77, 130], heads=20, rank=48, rope=8, block_size=8, block_n=32, partition_size=64
    ),
    # rows of 300 and 20 keys beside a 1,100-key row split in 256-key pieces stay whole
    "short_rows_stay_whole": Case([300, 1100, 20, 0], partition_size=256, short_context=1024),
    "float16_splitk": Case([3, 70, 0, 129], heads=16, partition_size=64, dtype="float16"),
}


def _reference(c: Case, q: object, cache: object, tables: object, lens: object) -> object:
    """TorchMLAAttention's decode in float64 over the same cache (rows of context > 0)."""
    import torch

    from ds4pool.model.attention import AttentionMetadata
    from ds4pool.model.attention_mla import TorchMLAAttention

    rows = torch.tensor([i for i, n in enumerate(c.context_lens) if n > 0])
    meta = AttentionMetadata(
        positions=rows, slot_mapping=rows, block_tables=tables.long(),
        context_lens=lens.long(), decode_rows=rows, decode_tokens=rows,
        max_decode_blocks=tables.shape[1], prefills=(), block_size=c.block_size,
    )  # fmt: skip
    scale = (c.rank + c.rope) ** -0.5
    return TorchMLAAttention._decode(q.double(), cache.double(), meta, scale, c.rank)


def _run_kernel_case(name: str) -> dict:
    import torch

    from ds4pool.model.kernels import triton_mla as tm
    from tests.paged_cases import make_case, poison_unused_slots, rel_err

    c = CASES[name]
    dtype = getattr(torch, c.dtype)
    n = len(c.context_lens)
    case = make_case(
        [1] * n, c.context_lens, heads=c.heads, kv_heads=1, head_dim=c.rank + c.rope,
        block_size=c.block_size, dtype=dtype,
    )  # fmt: skip
    q = case.q * 0.3  # softer scores: fp16 is not the test of exp's range
    # the reference gathers whole padded blocks (0 x NaN = NaN): it reads the clean cache
    ref = _reference(c, q, case.cache[:1].clone(), case.block_tables, case.context_lens)
    poison_unused_slots(case)  # a kernel that reads a slot no row owns turns NaN
    cache = case.cache[:1]  # [1, N, bs, 1, R + r]: the MLA layer cache
    launch = tm.MLADecodeLaunch(block_h=c.block_h, block_n=c.block_n)

    def decode(q_: object, tables: object, lens: object, partition: int) -> object:
        out = torch.full((q_.shape[0], c.heads, c.rank), float("nan"), dtype=dtype)
        tm.mla_decode(
            q_, cache[0], tables, lens, (c.rank + c.rope) ** -0.5, out,
            partition_size=partition, short_context=c.short_context, launch=launch,
        )  # fmt: skip
        return out

    out = decode(q, case.block_tables, case.context_lens, c.partition_size)
    live = [i for i, k in enumerate(c.context_lens) if k > 0]
    empty = [i for i, k in enumerate(c.context_lens) if k == 0]
    solo = True
    for i, k in enumerate(c.context_lens):
        if c.short_context and 0 < k <= c.short_context:  # alone, over its own narrow table
            width = -(-k // c.block_size)
            part = -(-width * c.block_size // c.block_n) * c.block_n
            alone = decode(q[i : i + 1], case.block_tables[i : i + 1, :width],
                           case.context_lens[i : i + 1], part)  # fmt: skip
            solo = solo and torch.equal(alone, out[i : i + 1])
    return {
        "name": name,
        "rel": rel_err(out[live], ref),
        "tolerance": c.tolerance,
        "finite": bool(torch.isfinite(out[live]).all()),
        "empty_zero": bool((out[empty] == 0).all()),
        "solo_equal": solo,
    }


def _run_model_case(name: str) -> dict:
    """The tiny DeepSeek-V3 (fp32, CPU), torch-mla + TorchOps vs triton-mla + TritonOps (the
    fused norms the runner pairs with it on CUDA), one trace each:
    two prompts, two decode-only steps, a mixed step (a new prompt beside the decode rows),
    two more decode steps. Logits of every step and greedy tokens are compared."""
    import torch

    from ds4pool.kv.blocks import BlockPool
    from ds4pool.model.attention_mla_triton import TritonMLAAttention
    from ds4pool.model.ops import TritonOps
    from ds4pool.model.runner import ModelRunner, SeqInput
    from tests.hf_models import tiny_loaded

    loaded = tiny_loaded(300, seed=5, arch="deepseek-v3")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (23, 6, 11)]

    def trace(triton: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
        runner = ModelRunner(loaded, num_blocks=40, block_size=4)
        if triton:  # what the runner picks on CUDA, here under the interpreter
            loaded.model.set_attention_backend(TritonMLAAttention(num_sms=4), TritonOps())
        pool = BlockPool(40)
        tables = [pool.allocate(-(-(len(p) + 8) // 4)) for p in prompts]
        tokens: list[list[int]] = [[], [], []]
        logits: list[torch.Tensor] = []

        def step(seqs: list[int], first: dict[int, bool]) -> None:
            inputs = [
                SeqInput(prompts[s], 0, tables[s]) if first.get(s)
                else SeqInput([tokens[s][-1]], len(prompts[s]) + len(tokens[s]) - 1, tables[s])
                for s in seqs
            ]  # fmt: skip
            out = runner.step(inputs, return_logits=True)
            assert out.logits is not None
            logits.append(out.logits.clone())
            for s, tok in zip(seqs, out.sampled):
                tokens[s].append(tok)

        step([0, 1], {0: True, 1: True})
        for _ in range(2):
            step([0, 1], {})
        step([0, 2, 1], {2: True})  # mixed: decode rows and a prompt chunk
        for _ in range(2):
            step([0, 1, 2], {})
        return tokens, logits

    ref_tokens, ref_logits = trace(False)
    tri_tokens, tri_logits = trace(True)
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(tri_logits, ref_logits))
    return {"name": name, "rel": err, "tolerance": 1e-5, "same_tokens": tri_tokens == ref_tokens}


def _run_case(name: str) -> dict:
    return _run_model_case(name) if name == "model" else _run_kernel_case(name)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    return interpreter_results(__file__, timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_mla_kernel_matches_the_reference(results: dict[str, dict], name: str) -> None:
    r = results[name]
    assert "error" not in r, r.get("error")
    assert r["finite"], "an output element was left unwritten (NaN) or read a poisoned slot"
    assert r["empty_zero"], "rows with context 0 must come back as zeros"
    assert r["rel"] < r["tolerance"], r
    assert r["solo_equal"], "a short row's output depends on the rows beside it"


def test_deepseek_decodes_the_same_on_the_triton_backend(results: dict[str, dict]) -> None:
    r = results["model"]
    assert "error" not in r, r.get("error")
    assert r["rel"] < r["tolerance"], r
    assert r["same_tokens"], "greedy tokens differ between the triton-mla and torch-mla backends"


if __name__ == "__main__":
    print_cases([*CASES, "model"], _run_case)
