"""No Triton compile in the middle of serving: after the start-up eager warm-up
(ModelRunner.warm_up_eager, model/warm_up.py), serving-like eager steps launch no kernel
variant that the warm-up did not already compile.

The real runner drives the Triton attention backend and the Triton ops on CPU with an
8B-shaped attention (32 heads of 128, 8 KV heads) and the H200's launch choices (132 SMs,
the deep prefill launch, the skinny-GEMM table's configs, PDL); each launch is recorded with
Triton's own specialisation rule instead of run (tests/triton_variants.py), so these tests
need no GPU. A compile on the H200 host takes 0.3-1.2 s (run L, docs/BENCHMARKS.md): a
variant first met while serving is a step that long. Four models: that Llama under the
triton and triton-split backends, a tiny DeepSeek-V3 under the latent (MLA) backend, and a
Qwen3-MoE layer with the experts' Triton decode kernels as an H200 picks them.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from ds4pool.model import experts, moe  # noqa: E402
from ds4pool.model.attention_mla_triton import TritonMLAAttention  # noqa: E402
from ds4pool.model.attention_triton import TritonPagedAttention  # noqa: E402
from ds4pool.model.config import ModelConfig  # noqa: E402
from ds4pool.model.demo import init_random_  # noqa: E402
from ds4pool.model.kernels import triton_attention, triton_linear_configs  # noqa: E402
from ds4pool.model.loader import LoadedModel, build_empty  # noqa: E402
from ds4pool.model.runner import ModelRunner, SeqInput  # noqa: E402
from ds4pool.model.warm_up import eager_shapes  # noqa: E402
from tests.hf_models import TINY_MOE, tiny_hf_config  # noqa: E402
from tests.triton_variants import recording  # noqa: E402

MAX_LEN = 32768
MAX_CHUNK = 2048  # the scheduler's prompt tokens a step on CUDA
MAX_ROWS = 64
BS = 16
NUM_BLOCKS = 4096


def llama_hf() -> dict[str, Any]:
    """One layer with Llama-3-8B's attention (32 heads of 128, 8 KV heads), small elsewhere."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 1,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": MAX_LEN,
    }


def mla_hf() -> dict[str, Any]:
    """tests/hf_models.py's tiny DeepSeek-V3 at MAX_LEN positions, one (dense) layer: its
    prefill runs the torch reference, slow at 32k contexts on CPU."""
    hf = tiny_hf_config(512, "deepseek-v3") | {"max_position_embeddings": MAX_LEN}
    hf |= {"num_hidden_layers": 1}
    hf["rope_parameters"] = hf["rope_parameters"] | {"original_max_position_embeddings": 8192}
    return hf


def moe_hf() -> dict[str, Any]:
    """llama_hf's attention in a Qwen3-MoE layer (q/k norms; 16 experts, top-4)."""
    moe = {"num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64}
    return llama_hf() | TINY_MOE | moe


def loaded_model(kind: str, device: torch.device) -> LoadedModel:
    """kind "triton" / "triton-split" / "triton-small": llama_hf's model; "triton-mla": mla_hf's;
    "triton-moe": moe_hf's. bf16, random weights, projections fused as the loader does."""
    hf = {"triton-mla": mla_hf, "triton-moe": moe_hf}.get(kind, llama_hf)()
    cfg = ModelConfig.from_hf(hf)
    model = build_empty(cfg, device, torch.bfloat16)
    init_random_(model, seed=0)
    model.fuse_projections()
    return LoadedModel(model, cfg, None, "t", None, device, torch.bfloat16, "t")  # type: ignore[arg-type]


def runner(kind: str) -> ModelRunner:
    """loaded_model(kind) on CPU behind the Triton backend of that kind, launched with the
    H200's choices."""
    cpu = torch.device("cpu")
    loaded = loaded_model(kind, cpu)
    if kind == "triton-mla":
        attention: Any = TritonMLAAttention(num_sms=132)
    else:
        attention = TritonPagedAttention(
            split_decode_rows=kind == "triton-split",
            num_sms=132,
            prefill_launch=triton_attention.DEEP_PREFILL,
            small_m=16 if kind == "triton-small" else 0,
        )
    r = ModelRunner(
        loaded,
        num_blocks=NUM_BLOCKS,
        block_size=BS,
        cuda_graphs=False,
        max_decode_batch=MAX_ROWS,
        kv_head_major=False,
        attention=attention,
    )
    ops = loaded.model.ops  # TritonOps, as on CUDA: the skinny GEMM's configs of the 8B's shapes
    template = triton_linear_configs.SKINNY_TABLE[(4096, 4096)]
    modules = loaded.model.modules()
    shapes = {tuple(m.weight.shape) for m in modules if isinstance(m, torch.nn.Linear)}
    ops.skinny_table = {shape: template for shape in shapes}
    ops._pdl_devices[cpu] = True  # as on sm_90
    return r


def serving_steps(seed: int, max_len: int) -> list[tuple[str, list[SeqInput]]]:
    """Eager steps as the scheduler makes them: decode rows beside one to eight prompt chunks
    (short tool results and long files), within the step's prompt-token budget, at contexts
    up to the model's length; and run L's 1-3 decode rows next to a chunk."""
    rng = random.Random(seed)
    nxt = 0

    def table(tokens: int) -> list[int]:
        nonlocal nxt
        n = -(-tokens // BS)
        nxt = (nxt + n) % (NUM_BLOCKS - n)
        return list(range(nxt, nxt + n))

    def step(decodes: list[int], chunks: list[tuple[int, int]]) -> list[SeqInput]:
        rows = [SeqInput([1], c - 1, table(c)) for c in decodes]
        return rows + [SeqInput([2] * q, c, table(c + q)) for q, c in chunks]

    steps = []
    for nd in (1, 2, 3):
        for ctx in (100, 2900):
            steps.append(
                (f"{nd} decode rows + a 17-token chunk at {ctx}", step([ctx] * nd, [(17, ctx)]))
            )
    for i in range(60):
        budget = MAX_CHUNK
        chunks = []
        for _ in range(rng.randint(1, 8)):
            q = rng.choice([rng.randint(2, 40), rng.randint(2, 600), rng.randint(200, 2048)])
            q = min(q, budget)
            if q < 2:
                break
            budget -= q
            chunks.append((q, rng.randint(0, max_len - q)))
        decodes = [rng.randint(2, max_len) for _ in range(rng.randint(0, MAX_ROWS - len(chunks)))]
        label = f"random step {i}: {len(decodes)} decode rows, chunks {[q for q, _ in chunks]}"
        steps.append((label, step(decodes, chunks)))
    return steps


def experts_as_on_cuda(
    device: torch.device,
    dtype: torch.dtype,
    requested: str = "auto",
    pairs: int | None = None,
    max_pairs: int = experts.DECODE_MAX_PAIRS,
) -> str:
    """expert_impl's choice on an H200: the Triton decode kernels up to max_pairs (token,
    expert) pairs; past them torch's grouped GEMM there, which launches no Triton kernel
    (the loop stands in for it on CPU)."""
    if requested == "auto" and pairs is not None and pairs <= max_pairs:
        return "decode"
    return "loop"


@pytest.mark.parametrize(
    "kind", ["triton", "triton-split", "triton-small", "triton-mla", "triton-moe"]
)
def test_serving_after_the_warm_up_compiles_nothing(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(moe, "expert_impl", experts_as_on_cuda)
    monkeypatch.setattr(experts, "expert_impl", experts_as_on_cuda)
    r = runner(kind)
    with recording() as rec:
        rec.label = "warm-up"
        report = r.warm_up_eager(MAX_CHUNK, max_seconds=600)
        assert report.left == 0
        assert report.steps == len(eager_shapes(r.max_model_len, MAX_CHUNK, MAX_ROWS))
        warmed = rec.variants()
        for label, seqs in serving_steps(seed=1, max_len=r.max_model_len):
            rec.label = label
            r.step(seqs)
    kernels = {name.rsplit(".", 1)[-1] for name in warmed}
    attention = "mla_decode_kernel" if kind == "triton-mla" else "prefill_kernel"
    assert attention in kernels, kernels
    if kind == "triton-moe":  # the experts' decode kernels, not only the attention's
        assert {"_gate_up_kernel", "_down_kernel", "_combine_kernel"} <= kernels, kernels
    assert rec.new_since(warmed) == []


def test_without_the_warm_up_the_same_steps_would_compile() -> None:
    """The control: one plain prompt step does not launch what the serving steps need, so
    the test above can fail (and fails if the warm-up stops covering a variant)."""
    r = runner("triton-split")
    with recording() as rec:
        r.step([SeqInput([2] * 64, 0, list(range(4)))])
        plain = rec.variants()
        for label, seqs in serving_steps(seed=1, max_len=MAX_LEN):
            rec.label = label
            r.step(seqs)
    new = rec.new_since(plain)
    assert any("prefill_kernel" in line and "SPLIT" in line for line in new), new
    assert any("decode_kernel" in line for line in new), new


def test_prefill_kernel_key_does_not_depend_on_the_decode_rows_before_the_chunk() -> None:
    """The split backend passes the prefill kernel its metadata from the first prompt row on:
    4 bytes a decode row in, so 16-byte aligned or not by the row count. The kernel does
    not specialise on those pointers (one compile, not one per alignment)."""
    r = runner("triton-split")
    with recording() as rec:
        for nd in range(6):
            rows = [SeqInput([1], 99, list(range(100 + 8 * i, 108 + 8 * i))) for i in range(nd)]
            r.step([*rows, SeqInput([2] * 17, 100, list(range(8)))])
    prefill = [v for name, v in rec.variants().items() if name.endswith("prefill_kernel")]
    assert len(prefill) == 1 and len(prefill[0]) == 1, prefill
