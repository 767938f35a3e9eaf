"""Tiny random Hugging Face checkpoints for fidelity tests, written with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ds4pool.model.config import ModelConfig
from ds4pool.model.demo import init_random_
from ds4pool.model.loader import LoadedModel, build_empty
from ds4pool.model.runner import ModelRunner

TINY = {
    "vocab_size": 384,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}

DEEPSEEK = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 4,  # = heads: MLA has no KV heads (transformers repeats by the ratio)
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,  # x factor 4 = max_position_embeddings
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "tie_word_embeddings": False,
    # DeepSeek's MoE: sigmoid router over 8 experts in 4 groups (a token picks among the best
    # 2 groups, then its top 2 experts), renormalised and scaled, plus one shared expert.
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}

# name → (config class name, extra config fields, over TINY's)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama3-tied": (
        "LlamaConfig",
        {
            "tie_word_embeddings": True,
            "head_dim": 32,  # explicit, != hidden / heads
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
    ),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", {"head_dim": 24, "tie_word_embeddings": False}),
    # 3 layers: sparse, dense (mlp_only_layers), sparse; 8 experts of width 32, top-2
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 3,
            "head_dim": 24,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    # decoder_sparse_step 2 (layers 1 and 3 sparse), softmax weights not renormalised
    "qwen3-moe-step2": (
        "Qwen3MoeConfig",
        {
            "num_hidden_layers": 4,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 24,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48},
    ),
    # Multi-head latent attention: q through a LoRA (q_lora_rank), DeepSeek's interleaved rope
    # with yarn scaling (it rescales every frequency band, whatever the position; mscale !=
    # mscale_all_dim so that cos/sin carry a factor and the softmax scale another).
    # Layer 0 dense, layers 1-2 MoE.
    "deepseek-v3": ("DeepseekV3Config", {**DEEPSEEK, "first_k_dense_replace": 1}),
    # q_proj without a LoRA, the rotate-half rope layout, plain rope; one expert group (no
    # group limit), weights not renormalised, two shared experts.
    "deepseek-v3-plain": (
        "DeepseekV3Config",
        {
            **DEEPSEEK,
            "q_lora_rank": None,
            "rope_interleave": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "first_k_dense_replace": 1,
            "num_hidden_layers": 2,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "n_shared_experts": 2,
        },
    ),
}


def build_hf_model(
    name: str, directory: Path, dtype: torch.dtype = torch.float32, shard: bool = False
) -> Any:
    """Write a tiny random checkpoint to `directory`; return the transformers model."""
    import transformers

    cls_name, extra = CASES[name]
    config = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        # transformers initialises biases to 0 and norms to 1: perturb every tensor so
        # those code paths (Qwen2 qkv bias, q/k norms) are actually exercised.
        for pname, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * (0.05 if "norm" in pname else 0.08)
            base = 1.0 if "norm" in pname else 0.0
            p.copy_((base + noise).to(dtype))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # DeepSeek's router bias: 0 at init
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "5GB")
    return model


# Shapes for tiny_loaded besides its Llama: a Qwen3-MoE (8 experts of width 32, top-2, every
# layer sparse) and a DeepSeek-V3 (multi-head latent attention; a dense layer, then an MoE one
# with DeepSeek's router and a shared expert).
TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"],
    **{k: v for k, v in DEEPSEEK.items() if k not in ("num_hidden_layers", "rope_parameters")},
    "rope_parameters": {**DEEPSEEK["rope_parameters"], "original_max_position_embeddings": 64},
    "first_k_dense_replace": 1,
}


def tiny_hf_config(vocab: int, arch: str = "llama") -> dict[str, Any]:
    """config.json fields of a 2-layer model (hidden 64, 4 heads): arch "llama" (GQA 4/2),
    "qwen3-moe" (that with TINY_MOE) or "deepseek-v3" (TINY_DEEPSEEK)."""
    extra = {"qwen3-moe": TINY_MOE, "deepseek-v3": TINY_DEEPSEEK, "llama": {}}[arch]
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        **extra,
    }


def tiny_loaded(vocab: int, seed: int, arch: str = "llama") -> LoadedModel:
    """tiny_hf_config's model with random weights on CPU in fp32, built in memory (no
    tokenizer)."""
    cfg = ModelConfig.from_hf(tiny_hf_config(vocab, arch))
    model = build_empty(cfg, torch.device("cpu"), torch.float32)
    init_random_(model, seed=seed)
    cpu = torch.device("cpu")
    return LoadedModel(model, cfg, None, "t", None, cpu, torch.float32, f"t-{arch}")  # type: ignore[arg-type]


def tiny_runner(vocab: int, seed: int, block_size: int, arch: str = "llama") -> ModelRunner:
    """tiny_loaded's model behind a ModelRunner with 128 blocks: for runner-level batching
    and masking tests."""
    return ModelRunner(tiny_loaded(vocab, seed, arch), num_blocks=128, block_size=block_size)
