"""Multi-head latent attention: the latent cache layout, the DeepSeek-V3 preset, config checks.
(Fidelity against transformers is in test_fidelity.py, the tiers in test_pool.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.errors import DeviceError, ModelLoadError
from ds4pool.model.config import ModelConfig
from ds4pool.model.demo import preset_config
from ds4pool.model.registry import family_for
from ds4pool.model.runner import ModelRunner, SeqInput, select_backend
from tests.hf_models import tiny_hf_config, tiny_loaded


def test_the_cache_holds_one_latent_per_token_and_layer() -> None:
    loaded = tiny_loaded(300, seed=1, arch="deepseek-v3")
    mla = loaded.config.mla
    assert mla is not None
    runner = ModelRunner(loaded, num_blocks=8, block_size=4)
    # [planes, blocks + scratch, block size, heads, kv_lora_rank + qk_rope_head_dim]
    assert all(c.shape == (1, 9, 4, 1, 32 + 8) for c in runner.kv_caches)
    assert runner.layout.kind == "mla"
    per_token = loaded.config.kv_bytes_per_token(4)
    assert per_token == runner.layout.bytes_per_token == 2 * (32 + 8) * 4  # 2 layers, fp32
    assert runner.kv_bytes == per_token * 9 * 4


def test_deepseek_v3_small_preset_fits_one_h200() -> None:
    cfg = preset_config("random:deepseek-v3-small")
    with torch.device("meta"):  # no memory: count the parameters of the real module tree
        model = family_for(cfg.architecture).model_class(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert params == 15_752_904_448  # the count docs/BENCHMARKS.md states
    assert params * 2 < 40 << 30  # bf16 weights: ~29 GiB of the H200's 141 GB
    assert cfg.mla is not None and cfg.mla.latent_dim == 576 and cfg.mla.q_lora_rank == 768
    assert cfg.kv_bytes_per_token(2) == 27 * 576 * 2 == 31_104
    assert cfg.moe is not None and cfg.moe.router == "sigmoid_group_topk"
    assert cfg.moe.sparse_layers == tuple(range(1, 27)) and cfg.moe.num_shared_experts == 2
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40.0


def test_random_init_fills_the_router_bias_deterministically() -> None:
    # e_score_correction_bias is a checkpoint buffer, not a parameter: to_empty() leaves it
    # uninitialised unless the random init covers it.
    def biases() -> list[torch.Tensor]:
        m = tiny_loaded(300, seed=4, arch="deepseek-v3").model
        return [b for n, b in m.named_buffers() if n.endswith("e_score_correction_bias")]

    first, second = biases(), biases()
    assert first and all(torch.isfinite(b).all() and b.abs().sum() > 0 for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_mla_backend_choice_follows_the_dense_one() -> None:
    # auto: the torch reference off CUDA (TritonMLAAttention on CUDA: tests/gpu)
    assert select_backend("auto", torch.device("cpu"), "mla").name == "torch-mla"
    assert select_backend("torch", torch.device("cpu"), "mla").name == "torch-mla"
    with pytest.raises(DeviceError, match="needs CUDA"):
        select_backend("triton", torch.device("cpu"), "mla")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_backend("flash", torch.device("cpu"), "mla")
    with pytest.raises(DeviceError, match="triton-split attention backend needs CUDA"):
        select_backend("triton-split", torch.device("cpu"))
    with pytest.raises(DeviceError, match="triton-small attention backend needs CUDA"):
        select_backend("triton-small", torch.device("cpu"))


def test_yarn_rope_is_accepted_for_deepseek_only() -> None:
    deepseek = tiny_hf_config(100, "deepseek-v3")
    llama = dict(tiny_hf_config(100), rope_parameters=deepseek["rope_parameters"])
    with pytest.raises(ModelLoadError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_hf(llama)
    cfg = ModelConfig.from_hf(deepseek)
    assert cfg.rope.kind == "yarn" and cfg.rope.mscale_all_dim == 0.8


def test_bad_mla_config_is_one_clear_line() -> None:
    deepseek = tiny_hf_config(100, "deepseek-v3")
    with pytest.raises(ModelLoadError, match="qk_rope_head_dim=7"):
        ModelConfig.from_hf(dict(deepseek, qk_rope_head_dim=7))
    del deepseek["kv_lora_rank"]
    with pytest.raises(ModelLoadError, match="kv_lora_rank"):
        ModelConfig.from_hf(deepseek)


def test_routers_stay_float32_in_a_bf16_model() -> None:
    # as transformers keeps them: a bf16 router bias would move tokens to other experts
    from ds4pool.model.loader import build_empty
    from ds4pool.model.moe import SparseMoeBlock

    cfg = ModelConfig.from_hf(tiny_hf_config(100, "deepseek-v3"))
    model = build_empty(cfg, torch.device("cpu"), torch.bfloat16)
    sparse = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse
    for mlp in sparse:
        assert mlp.gate.weight.dtype == mlp.gate.e_score_correction_bias.dtype == torch.float32
        assert mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_long_prompt_chunks_lift_the_latent_and_agree_with_the_absorbed_form() -> None:
    from ds4pool.kv.blocks import BlockPool
    from ds4pool.model.mla import MLAAttention

    loaded = tiny_loaded(300, seed=2, arch="deepseek-v3")
    runner = ModelRunner(loaded, num_blocks=16, block_size=8)
    attns = [m for m in loaded.model.modules() if isinstance(m, MLAAttention)]
    # kv_lora_rank 32, dn + dv = 40: chunks of more than 32 * 40 / 24 = 53.3 queries lift
    assert all(a.lift_min_queries == pytest.approx(53.33, abs=0.01) for a in attns)
    ids = torch.randint(0, 300, (70,), generator=torch.Generator().manual_seed(0)).tolist()

    def last_logits() -> torch.Tensor:
        table = BlockPool(16).allocate(9)
        out = runner.step([SeqInput(ids, 0, table)], return_logits=True)
        assert out.logits is not None
        return out.logits[0]

    lifted = last_logits()
    for a in attns:
        a.lift_min_queries = float("inf")  # every chunk absorbed
    absorbed = last_logits()
    assert (lifted - absorbed).abs().max().item() < 1e-5


def test_deepseek_checkpoint_with_mtp_layers_loads_without_them(tmp_path: Path) -> None:
    # DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the decoder
    # (model.layers.61 of 61 layers): not part of decoding, skipped at load.
    from safetensors.torch import save_file

    from tests.hf_models import build_hf_model
    from tests.unit.test_fidelity import load_ours

    hf = build_hf_model("deepseek-v3-plain", tmp_path)  # 2 layers
    n = hf.config.num_hidden_layers
    extra = {
        f"model.layers.{n}.eh_proj.weight": torch.zeros(64, 128),
        f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.zeros(160, 32),
    }
    save_file(extra, str(tmp_path / "mtp.safetensors"))
    ours = load_ours(tmp_path, torch.float32, torch.device("cpu"))
    assert len(ours.model.model.layers) == n
    save_file(
        {"model.layers.0.self_attn.surprise.weight": torch.zeros(2)},
        str(tmp_path / "x.safetensors"),
    )
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        load_ours(tmp_path, torch.float32, torch.device("cpu"))
