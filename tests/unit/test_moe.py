"""Routers against transformers' router modules, the grouped expert path against the per-expert
reference loop, and the registry's weight mapping (CPU; the CUDA path: tests/gpu/test_moe_cuda.py).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ds4pool.errors import ModelLoadError
from ds4pool.model.config import ARCHITECTURES, ModelConfig, MoEConfig
from ds4pool.model.experts import DECODE_MAX_PAIRS, expert_impl, grouped_experts, looped_experts
from ds4pool.model.registry import REGISTRY, WeightTarget, family_for
from ds4pool.model.routers import (
    route,
    route_sigmoid_group_topk,
    route_softmax_topk,
    route_topk_softmax,
)

transformers = pytest.importorskip("transformers")
HF = "transformers.models"


def hf_router(cls_path: str, config: object, weight: torch.Tensor) -> torch.nn.Module:
    module_name, cls_name = cls_path.rsplit(".", 1)
    cls = getattr(__import__(module_name, fromlist=[cls_name]), cls_name)
    router = cls(config)
    with torch.no_grad():
        router.weight.copy_(weight)
    return router.requires_grad_(False)


def as_sets(ids: torch.Tensor, weights: torch.Tensor) -> list[dict[int, float]]:
    """Per token {expert: weight}: routers may list the same k experts in another order."""
    return [
        {int(e): float(w) for e, w in zip(row_ids, row_w)} for row_ids, row_w in zip(ids, weights)
    ]


def assert_same_routing(got: tuple, want_w: torch.Tensor, want_ids: torch.Tensor) -> None:
    got_w, got_ids = got
    assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
    for g, w in zip(as_sets(got_ids, got_w), as_sets(want_ids, want_w)):
        assert g.keys() == w.keys()
        assert all(abs(g[e] - w[e]) < 1e-6 for e in g)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_topk_router_matches_qwen3_moe(norm: bool) -> None:
    cfg = transformers.Qwen3MoeConfig(
        hidden_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=norm
    )
    weight = torch.randn(16, 32)
    x = torch.randn(50, 32)
    router = hf_router(f"{HF}.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", cfg, weight)
    _, want_w, want_ids = router(x)
    assert_same_routing(route_softmax_topk(x @ weight.T, 4, norm), want_w, want_ids)
    if norm:
        assert torch.allclose(want_w.sum(-1), torch.ones(50))


def test_topk_softmax_router_matches_mixtral() -> None:
    cfg = transformers.MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    weight = torch.randn(8, 32)
    x = torch.randn(50, 32)
    router = hf_router(f"{HF}.mixtral.modeling_mixtral.MixtralTopKRouter", cfg, weight)
    _, want_w, want_ids = router(x)
    assert_same_routing(route_topk_softmax(x @ weight.T, 2), want_w, want_ids)


@pytest.mark.parametrize(("n_group", "topk_group", "norm"), [(4, 2, True), (1, 1, False)])
def test_sigmoid_group_topk_router_matches_deepseek_v3(
    n_group: int, topk_group: int, norm: bool
) -> None:
    cfg = transformers.DeepseekV3Config(
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    weight = torch.randn(16, 32)
    bias = torch.randn(16) * 0.5  # large enough to change which experts win
    x = torch.randn(50, 32)
    router = hf_router(f"{HF}.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter", cfg, weight)
    router.e_score_correction_bias.copy_(bias)
    _, want_w, want_ids = router(x)
    got = route_sigmoid_group_topk(x @ weight.T, 4, bias, n_group, topk_group, norm, 2.5)
    assert_same_routing(got, want_w, want_ids)
    unbiased = route_sigmoid_group_topk(x @ weight.T, 4, None, n_group, topk_group, norm, 2.5)
    assert not torch.equal(unbiased[1].sort(-1)[0], got[1].sort(-1)[0])  # the bias chose


def test_route_dispatches_on_the_config() -> None:
    logits = torch.randn(5, 8)
    moe = MoEConfig(8, 2, 16, "topk_softmax", sparse_layers=(0,))
    assert torch.equal(route(moe, logits)[1], route_topk_softmax(logits, 2)[1])


def experts(e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=gen) * 0.1, torch.randn(e, h, i, generator=gen) * 0.1


@pytest.mark.parametrize(("tokens", "e", "k"), [(1, 8, 2), (7, 16, 4), (64, 8, 2), (40, 64, 8)])
def test_grouped_experts_equal_the_reference_loop(tokens: int, e: int, k: int) -> None:
    gate_up, down = experts(e, 32, 16, seed=tokens)
    x = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(1))
    weights, ids = route_softmax_topk(torch.randn(tokens, e), k, True)
    want = looped_experts(x, weights, ids, gate_up, down)
    got = grouped_experts(x, weights, ids, gate_up, down)
    assert (got - want).abs().max().item() < 1e-5
    # and both equal the plain definition, token by token
    for t in range(tokens):
        acc = torch.zeros(32)
        for w, ex in zip(weights[t], ids[t]):
            g, u = (gate_up[ex] @ x[t]).chunk(2)
            acc += w * (down[ex] @ (torch.nn.functional.silu(g) * u))
        assert (want[t] - acc).abs().max().item() < 1e-5


def test_an_expert_nobody_chose_does_not_matter() -> None:
    gate_up, down = experts(8, 32, 16, seed=0)
    x = torch.randn(10, 32)
    ids = torch.tensor([[0, 3]] * 10)
    weights = torch.full((10, 2), 0.5)
    before = grouped_experts(x, weights, ids, gate_up, down)
    gate_up[5].fill_(float("nan"))  # never chosen: never read
    down[5].fill_(float("nan"))
    assert torch.equal(grouped_experts(x, weights, ids, gate_up, down), before)
    assert torch.equal(looped_experts(x, weights, ids, gate_up, down), before)


def test_moe_config_from_hf_sparse_layers() -> None:
    base = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    cfg = ModelConfig.from_hf({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert cfg.moe is not None and cfg.moe.sparse_layers == (1, 5)
    assert ModelConfig.from_hf({**base, "num_experts": 0}).moe is None
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=9"):
        ModelConfig.from_hf({**base, "num_experts_per_tok": 9})


def test_registry_covers_every_architecture_the_config_accepts() -> None:
    assert set(REGISTRY) == set(ARCHITECTURES)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        family_for("GPT2LMHeadModel")


def test_mixtral_mapping_stacks_experts_and_renames_the_block() -> None:
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["MixtralForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        }
    )
    m = family_for("MixtralForCausalLM").map_weight
    pre = "model.layers.0.block_sparse_moe"
    stacked = "model.layers.0.mlp.experts"
    assert m(f"{pre}.experts.3.w1.weight", cfg) == WeightTarget(
        f"{stacked}.gate_up_proj", (3, slice(0, 48))
    )
    assert m(f"{pre}.experts.3.w3.weight", cfg) == WeightTarget(
        f"{stacked}.gate_up_proj", (3, slice(48, 96))
    )
    assert m(f"{pre}.experts.2.w2.weight", cfg) == WeightTarget(f"{stacked}.down_proj", (2,))
    assert m(f"{pre}.gate.weight", cfg) == WeightTarget("model.layers.0.mlp.gate.weight")
    assert m("model.norm.weight", cfg) == WeightTarget("model.norm.weight")


def test_qwen3_30b_a3b_preset_has_the_published_size() -> None:
    from ds4pool.model.demo import preset_config
    from ds4pool.model.loader import build_empty

    cfg = preset_config("random:qwen3-30b-a3b")
    model = build_empty(cfg, torch.device("meta"), torch.bfloat16)  # shapes only
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert cfg.moe is not None and len(cfg.moe.sparse_layers) == 48
    active = total - experts + experts * cfg.moe.top_k // cfg.moe.num_experts
    assert round(total / 1e9, 1) == 30.5 and round(active / 1e9, 1) == 3.4  # "30B-A3B"
    assert experts == 48 * 128 * cfg.moe.expert_bytes(2048, 1)


def test_a_checkpoint_missing_one_expert_tensor_fails_to_load(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from ds4pool.model.loader import build_empty, load_config, load_weights, weight_files
    from tests.hf_models import build_hf_model

    build_hf_model("mixtral", tmp_path)
    cfg = load_config(tmp_path)
    [f] = weight_files(tmp_path)
    state = load_file(f)
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]  # one expert's up_proj
    save_file(state, f)
    with pytest.raises(ModelLoadError, match=r"missing 1 tensor.*layers\.1\.mlp\.experts\.gate_up"):
        load_weights(build_empty(cfg, torch.device("cpu"), torch.float32), [f], False)


def test_a_deepseek_router_holds_its_correction_bias_as_a_checkpoint_tensor() -> None:
    """e_score_correction_bias is a buffer the loader fills from the checkpoint (it is not
    a parameter); other routers have none."""
    from ds4pool.model.loader import checkpoint_tensors
    from ds4pool.model.moe import SparseMoeBlock

    moe = MoEConfig(8, 2, 16, "sigmoid_group_topk", (0,), n_group=2, topk_group=1)
    block = SparseMoeBlock(moe, 32)
    names = set(checkpoint_tensors(block))
    assert "gate.e_score_correction_bias" in names
    assert "gate.e_score_correction_bias" not in dict(block.named_parameters())
    plain = SparseMoeBlock(MoEConfig(8, 2, 16, "softmax_topk", (0,)), 32)
    assert plain.gate.e_score_correction_bias is None
    assert "gate.e_score_correction_bias" not in set(checkpoint_tensors(plain))


def test_auto_takes_the_decode_kernels_for_small_cuda_steps_only() -> None:
    """The pick is by the step's (token, expert) pairs, on the host from shapes alone (a CUDA
    graph bucket keeps its path); float16 keeps torch's grouped_mm (bf16 only) out of it."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert expert_impl(cuda, torch.float16, "auto", pairs=8) == "decode"
    assert expert_impl(cuda, torch.float16, "auto", pairs=DECODE_MAX_PAIRS) == "decode"
    assert expert_impl(cuda, torch.float16, "auto", pairs=DECODE_MAX_PAIRS + 1) == "triton"
    assert expert_impl(cuda, torch.float16, "auto", pairs=64, max_pairs=32) == "triton"
    assert expert_impl(cuda, torch.float16, "auto") == "triton"  # no step: the large-step path
    assert expert_impl(cpu, torch.float32, "auto", pairs=8) == "loop"
    assert expert_impl(cpu, torch.float32, "decode", pairs=8) == "decode"  # pinned: as asked
