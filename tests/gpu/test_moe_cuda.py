"""The CUDA expert paths: torch's grouped GEMM and the Triton kernel against the per-expert
reference loop, each captured in a CUDA graph, and whole MoE decode steps replayed from graphs
against the eager forward.

torch's grouped_mm needs an sm90/sm100 GPU and bf16 (its tests skip elsewhere); the Triton
kernel runs on any CUDA GPU with triton, in every dtype.
"""

from __future__ import annotations

import pytest
import torch

from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.config import ModelConfig
from ds4pool.model.demo import init_random_
from ds4pool.model.experts import (
    DECODE_MAX_PAIRS,
    expert_impl,
    experts_forward,
    grouped_experts,
    grouped_mm_supported,
    looped_experts,
)
from ds4pool.model.loader import LoadedModel, build_empty
from ds4pool.model.moe import SparseMoeBlock
from ds4pool.model.routers import route_softmax_topk
from ds4pool.model.runner import ModelRunner, SeqInput

pytestmark = pytest.mark.cuda
CUDA = torch.device("cuda")


def needs(gemm: str) -> None:
    if gemm == "grouped_mm" and not grouped_mm_supported(CUDA, torch.bfloat16):
        pytest.skip("torch has no sync-free bf16 grouped_mm on this GPU (needs sm90/sm100)")
    if gemm in ("triton", "decode", "auto"):
        pytest.importorskip("triton")


GEMMS = ["grouped_mm", "triton"]


def moe_inputs(tokens: int, e: int = 16, k: int = 4, h: int = 256, i: int = 128, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) * h**-0.5
    down = torch.randn(e, h, i, generator=gen) * i**-0.5
    x = torch.randn(tokens, h, generator=gen)
    weights, ids = route_softmax_topk(torch.randn(tokens, e, generator=gen), k, True)
    return x, weights, ids, gate_up, down


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("tokens", [1, 7, 64, 513])
def test_grouped_gemm_matches_the_reference_loop(tokens: int, gemm: str) -> None:
    needs(gemm)
    x, w, ids, gate_up, down = moe_inputs(tokens)
    truth = looped_experts(x.double(), w, ids, gate_up.double(), down.double())  # fp64, CPU
    bf = [t.to(CUDA, torch.bfloat16) for t in (x, gate_up, down)]
    w, ids = w.to(CUDA), ids.to(CUDA)
    grouped = grouped_experts(bf[0], w, ids, bf[1], bf[2], gemm=gemm)
    looped = looped_experts(bf[0], w, ids, bf[1], bf[2])
    assert grouped.dtype == torch.bfloat16 and grouped.shape == x.shape
    # both in bf16: each within bf16 rounding of the truth, the grouped no worse than the loop
    assert rel_err(grouped.cpu(), truth) < 2e-2
    assert rel_err(grouped.cpu(), truth) <= 1.25 * rel_err(looped.cpu(), truth) + 1e-3


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("tokens", [1, 3, 8, 16, 32])
def test_decode_path_matches_the_reference_loop(tokens: int, dtype: str) -> None:
    """The small-batch kernels (GEMV rows below 16 tokens, tl.dot from 16) vs the loop."""
    needs("decode")
    dt = getattr(torch, dtype)
    x, w, ids, gate_up, down = moe_inputs(tokens, e=64, k=8, h=512, i=192)
    truth = looped_experts(x.double(), w, ids, gate_up.double(), down.double())
    xs, gu, dn = (t.to(CUDA, dt) for t in (x, gate_up, down))
    w, ids = w.to(CUDA), ids.to(CUDA)
    got = experts_forward(xs, w, ids, gu, dn, impl="decode")
    looped = looped_experts(xs, w, ids, gu, dn)
    assert got.dtype == dt and got.shape == x.shape
    if dtype == "float32":
        assert rel_err(got.cpu(), truth) < 1e-4  # tf32 is not used for float32 inputs
    else:
        assert rel_err(got.cpu(), truth) <= 1.25 * rel_err(looped.cpu(), truth) + 1e-3


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_every_swept_decode_config_compiles_and_matches_the_loop(tokens: int) -> None:
    """What bench/moe_layer.py --sweep may put in DECODE_CONFIGS, compiled for this GPU:
    every tile shape, and every warps x stages of the largest (a config the GPU cannot fit
    is skipped by the sweep, so here; all ~500 combinations would be minutes of compiles)."""
    needs("decode")
    from triton.runtime.errors import OutOfResources

    from ds4pool.model.kernels.triton_moe_configs import (
        DEFAULT,
        SWEEP_GEMV_TOKENS,
        DecodeConfig,
        sweep_gemv_shapes,
        sweep_schedules,
        sweep_shapes,
    )
    from ds4pool.model.kernels.triton_moe_decode import decode_experts
    from ds4pool.model.kernels.triton_moe_route import expert_groups

    x, w, ids, gate_up, down = moe_inputs(tokens, e=64, k=8, h=512, i=192)
    truth = looped_experts(x.double(), w, ids, gate_up.double(), down.double())
    xs, gu, dn = (t.to(CUDA, torch.bfloat16) for t in (x, gate_up, down))
    w, ids = w.to(CUDA), ids.to(CUDA)
    bound = 1.25 * rel_err(looped_experts(xs, w, ids, gu, dn).cpu(), truth) + 1e-3
    groups = expert_groups(ids, 64)
    shapes = sweep_shapes()
    tiles = set(shapes) | set(sweep_schedules(max(shapes, key=lambda t: (t.block_n, t.block_k))))
    configs = [
        c for t in tiles for c in (DecodeConfig(t, DEFAULT.down), DecodeConfig(DEFAULT.gate_up, t))
    ]
    if tokens <= SWEEP_GEMV_TOKENS:  # the sweep tries GEMV tiles there too, narrow ones too
        configs += [DecodeConfig(t, t, gemv=True) for t in shapes + sweep_gemv_shapes()]
    bad = {}
    for config in sorted(configs, key=repr):
        try:
            got = decode_experts(xs, w, ids, groups, gu, dn, config=config)
        except OutOfResources:
            continue
        err = rel_err(got.cpu(), truth)
        if not err <= bound:
            bad[repr(config)] = err
    assert not bad, bad


@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_tma_weight_loads_replay_from_a_graph_as_pointer_loads_run(tokens: int) -> None:
    """A TMA config (ProjTiles.tma) captured in a CUDA graph: the descriptors are launch
    arguments fixed at capture, so a replay after new inputs and routing are copied into the
    captured buffers must give what the same config gives eagerly for them (bitwise: fixed
    sum order) and what pointer loads give (to bf16 rounding), and the PTX must use TMA at
    all (else the case proves nothing)."""
    needs("decode")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90 or later (decode_experts falls back to pointer loads)")
    from dataclasses import replace

    from ds4pool.model.kernels.triton_moe_configs import DecodeConfig, ProjTiles
    from ds4pool.model.kernels.triton_moe_decode import decode_experts
    from ds4pool.model.kernels.triton_moe_route import expert_groups

    e = 64
    tma = DecodeConfig(ProjTiles(32, 128, 1, 4, 4, True), ProjTiles(64, 128, 2, 2, 4, True))
    ptr = DecodeConfig(replace(tma.gate_up, tma=False), replace(tma.down, tma=False))
    x, w, ids, gate_up, down = (t.to(CUDA) for t in moe_inputs(tokens, e=e, k=8, h=512, i=192))
    x, gate_up, down = (t.to(torch.bfloat16) for t in (x, gate_up, down))
    groups = expert_groups(ids, e)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_experts(x, w, ids, groups, gate_up, down, config=tma)  # compile outside
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_experts(x, w, ids, groups, gate_up, down, config=tma)
    x2, w2, ids2, _, _ = (t.to(CUDA) for t in moe_inputs(tokens, e=e, k=8, h=512, i=192, seed=1))
    x.copy_(x2.to(torch.bfloat16))
    w.copy_(w2)
    ids.copy_(ids2)
    groups.copy_(expert_groups(ids2, e))
    graph.replay()
    assert torch.equal(out, decode_experts(x, w, ids, groups, gate_up, down, config=tma))
    assert rel_err(out, decode_experts(x, w, ids, groups, gate_up, down, config=ptr)) < 1e-2
    kernels = [k for k in decode_experts_kernels() if "cp.async.bulk.tensor" in k]
    assert kernels, "no expert kernel was compiled with TMA loads"


def decode_experts_kernels() -> list[str]:
    """The PTX of every compiled variant of the two expert kernels in this process."""
    from ds4pool.model.kernels import triton_moe_decode as md

    ptx = []
    for fn in (md._gate_up_kernel, md._down_kernel):
        for cache in fn.device_caches.values():
            ptx += [k.asm["ptx"] for k in cache[0].values()]
    return ptx


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize(
    ("router", "experts", "n_group", "topk_group"),
    [("softmax_topk", 128, 1, 1), ("topk_softmax", 8, 1, 1), ("sigmoid_group_topk", 256, 8, 4)],
)
def test_fused_router_matches_the_torch_router(
    router: str, experts: int, n_group: int, topk_group: int, tokens: int
) -> None:
    """The compiled route kernel (not the interpreter) against model/routers.py, float32
    logits: the same experts (as sets: DeepSeek's reference top-k is unsorted), the same
    weights, and the step's distinct experts as groups."""
    needs("decode")
    from ds4pool.model.config import MoEConfig
    from ds4pool.model.kernels.triton_moe_route import route_fused
    from ds4pool.model.routers import route

    k = 2 if experts == 8 else 8
    moe = MoEConfig(experts, k, 16, router, (0,), True, n_group, topk_group, 2.5)
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, experts, generator=gen).to(CUDA)
    bias = (torch.rand(experts, generator=gen) * 0.2).to(CUDA) if n_group > 1 else None
    w, ids, groups = route_fused(moe, logits, bias)
    want_w, want_ids = route(moe, logits, bias)
    o, wo = ids.argsort(dim=1), want_ids.argsort(dim=1)
    assert torch.equal(ids.gather(1, o), want_ids.gather(1, wo))
    assert torch.allclose(w.gather(1, o), want_w.gather(1, wo), atol=1e-6)
    distinct = torch.unique(want_ids).tolist()
    assert groups.tolist() == distinct + [-1] * (min(experts, tokens * k) - len(distinct))


def test_auto_takes_the_decode_path_for_small_steps_only() -> None:
    needs("decode")
    assert expert_impl(CUDA, torch.bfloat16, "auto", pairs=8) == "decode"
    assert expert_impl(CUDA, torch.bfloat16, "auto", pairs=DECODE_MAX_PAIRS) == "decode"
    assert expert_impl(CUDA, torch.bfloat16, "auto", pairs=DECODE_MAX_PAIRS + 1) != "decode"
    assert expert_impl(CUDA, torch.bfloat16, "auto") != "decode"  # the large-step choice


@pytest.mark.parametrize(
    ("gemm", "dtype"), [("grouped_mm", "bfloat16"), ("triton", "float16"), ("decode", "bfloat16")]
)
def test_grouped_experts_capture_in_a_cuda_graph(gemm: str, dtype: str) -> None:
    """No host sync: the grouped path records into a graph, and replays give what an eager
    call gives for new routing copied into the same buffers."""
    needs(gemm)
    dt = getattr(torch, dtype)
    x, w, ids, gate_up, down = moe_inputs(32)
    sx, sw, sids = x.to(CUDA, dt), w.to(CUDA), ids.to(CUDA)
    gu, dn = gate_up.to(CUDA, dt), down.to(CUDA, dt)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        experts_forward(sx, sw, sids, gu, dn, impl=gemm)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts_forward(sx, sw, sids, gu, dn, impl=gemm)
    for seed in (1, 2, 3):  # other tokens, other experts (some unchosen), same shapes
        x2, w2, ids2, _, _ = moe_inputs(32, seed=seed)
        sx.copy_(x2.to(CUDA, dt))
        sw.copy_(w2.to(CUDA))
        sids.copy_(ids2.to(CUDA))
        graph.replay()
        want = experts_forward(sx, sw, sids, gu, dn, impl=gemm)
        assert torch.equal(out, want)


def tiny_moe(dtype: torch.dtype) -> LoadedModel:
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": 512,
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 2048,
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 128,
            "norm_topk_prob": True,
        }
    )
    model = build_empty(cfg, CUDA, dtype)
    init_random_(model, seed=5, std=0.1)
    model.fuse_projections()
    return LoadedModel(model, cfg, None, "t", None, CUDA, dtype, "t")  # type: ignore[arg-type]


def decode(runner: ModelRunner, prompts: list[list[int]], steps: int):
    pool = BlockPool(runner.num_blocks)
    tables = [BlockTable(runner.block_size) for _ in prompts]
    last = []
    for p, t in zip(prompts, tables):
        t.ensure(pool, len(p))
        last.append(runner.step([SeqInput(p, 0, t.blocks)]).sampled[0])
    tokens, logits = [list(last)], []
    for k in range(steps):
        seqs = []
        for i, (p, t) in enumerate(zip(prompts, tables)):
            t.ensure(pool, len(p) + k + 1)
            seqs.append(
                SeqInput([last[i]], len(p) + k, t.blocks, seq_id=i + 1, table_epoch=t.epoch)
            )
        out = runner.step(seqs, return_logits=True)
        assert out.logits is not None
        logits.append(out.logits.clone())
        last = out.sampled
        tokens.append(list(last))
    return tokens, logits


@pytest.mark.parametrize(
    ("gemm", "dtype"),
    [
        ("grouped_mm", "bfloat16"),
        ("triton", "float32"),
        ("decode", "bfloat16"),
        ("auto", "bfloat16"),
    ],
)
def test_moe_decode_step_replays_from_a_cuda_graph(gemm: str, dtype: str) -> None:
    needs(gemm)
    loaded = tiny_moe(getattr(torch, dtype))
    for m in loaded.model.modules():
        if isinstance(m, SparseMoeBlock):
            m.impl = gemm
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 40, 23)]
    graphed = ModelRunner(loaded, num_blocks=64, cuda_graphs=True)
    eager = ModelRunner(loaded, num_blocks=64, cuda_graphs=False)
    assert graphed.graphs is not None
    g_tokens, g_logits = decode(graphed, prompts, 12)
    e_tokens, e_logits = decode(eager, prompts, 12)
    assert graphed.graphs.captures >= 1  # a batch of 3 runs bucket 4: one padding row
    assert g_tokens == e_tokens
    assert max(rel_err(g, e) for g, e in zip(g_logits, e_logits)) < 1e-2


def test_moe_on_the_reference_loop_decodes_eagerly() -> None:
    """The loop reads the chosen experts on the host: the model says so and the runner does
    not try to capture (a capture would fail on those reads)."""
    loaded = tiny_moe(torch.float32)
    for m in loaded.model.modules():
        if isinstance(m, SparseMoeBlock):
            m.impl = "loop"
    runner = ModelRunner(loaded, num_blocks=64, cuda_graphs=True)
    assert runner.graphs is None
    tokens, _ = decode(runner, [[1, 2, 3, 4, 5]], 4)
    assert len(tokens) == 5


ROUTE_SHAPES = [("softmax_topk", 128, 8, True), ("softmax_topk", 128, 8, False),
                ("topk_softmax", 8, 2, False)]  # fmt: skip


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tokens", [1, 2, 5, 16])  # past ROUTE_IN_GATE_UP_VERIFIED_TOKENS: a launch
@pytest.mark.parametrize(("router", "experts", "k", "norm"), ROUTE_SHAPES)
def test_routing_in_the_gate_up_equals_the_route_launch_bitwise(
    router: str, experts: int, k: int, norm: bool, tokens: int, ties: bool
) -> None:
    """Compiled (the interpreter cannot show it): the gate_up launch that routes the step
    stores the route launch's weights, ids and groups bit for bit and gives the same expert
    output, under the step's table config and under other warps (another layout of the
    router's tile in the kernel), GEMV and dot tiles, split-K."""
    needs("decode")
    from ds4pool.model.config import MoEConfig
    from ds4pool.model.kernels.triton_moe_configs import DecodeConfig, ProjTiles, config_for
    from ds4pool.model.kernels.triton_moe_decode import decode_experts
    from ds4pool.model.kernels.triton_moe_route import route_deferred, route_fused

    moe = MoEConfig(experts, k, 192, router, (0,), norm_topk_prob=norm)
    gen = torch.Generator().manual_seed(tokens)
    x, _, _, gate_up, down = moe_inputs(tokens, e=experts, k=k, h=512, i=192)
    x, gate_up, down = (t.to(CUDA, torch.bfloat16) for t in (x, gate_up, down))
    logits = torch.randn(tokens, experts, generator=gen)
    if ties:  # most tokens tie, some across the k-th place
        logits = torch.randint(-2, 3, (tokens, experts), generator=gen).float()
    logits = logits.to(CUDA, torch.bfloat16)  # the router linear's output dtype
    configs = [
        config_for(tokens),
        DecodeConfig(ProjTiles(16, None, 1, 2), ProjTiles(32), gemv=tokens <= 2),
        DecodeConfig(ProjTiles(64, 64, 2, 8, 2), ProjTiles(64, 128, 2, 8)),
    ]
    w, ids, groups = route_fused(moe, logits)
    for config in configs:
        apart = decode_experts(x, w, ids, groups, gate_up, down, config=config)
        route = route_deferred(moe, logits)
        fused = decode_experts(
            x, route.weights, route.ids, route.groups, gate_up, down, config=config, route=route
        )
        assert torch.equal(route.ids, ids), config
        assert torch.equal(route.weights, w), config
        assert torch.equal(route.groups, groups), config
        assert torch.equal(fused, apart), config


@pytest.mark.parametrize("tokens", [1, 8])
def test_block_routed_in_the_gate_up_replays_from_a_graph(tokens: int) -> None:
    """A Qwen3-30B-A3B-shaped layer (128 experts, top-8) on the decode path with the routing
    in its gate_up launch: equal bitwise to the separately routed block, and a CUDA graph of
    it replays what an eager forward gives for new inputs (no host sync, the grid fixed by
    the shapes however many experts the step chose)."""
    needs("decode")
    from ds4pool.model.config import MoEConfig

    moe = MoEConfig(128, 8, 192, "softmax_topk", (0,), norm_topk_prob=True)
    block = SparseMoeBlock(moe, 512).to(CUDA, torch.bfloat16)
    gen = torch.Generator(device=CUDA).manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05, generator=gen)
    block.impl = "decode"
    x = torch.randn(tokens, 512, device=CUDA, dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():
        block.decode_route_in_gate_up = False
        apart = block(x)
        block.decode_route_in_gate_up = True
        assert torch.equal(block(x), apart)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            block(x)  # compile outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = block(x)
        for _ in range(3):  # other tokens: other experts, other counts of them
            x.copy_(torch.randn(x.shape, device=CUDA, dtype=x.dtype, generator=gen))
            graph.replay()
            assert torch.equal(out, block(x))
