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

# name → (config class name, extra config fields)
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
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory, max_shard_size="40KB" if shard else "5GB")
    return model


# A Qwen3-MoE shape for tiny_runner: 8 experts of width 32, top-2, every layer sparse.
TINY_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}


def tiny_runner(vocab: int, seed: int, block_size: int, moe: bool = False) -> ModelRunner:
    """A 2-layer random Llama (GQA 4/2, hidden 64; with `moe`, the Qwen3-MoE of TINY_MOE) on
    CPU in fp32 behind a ModelRunner with 128 blocks, built in memory (no tokenizer): for
    runner-level batching and masking tests."""
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
            **(TINY_MOE if moe else {}),
        }
    )
    model = build_empty(cfg, torch.device("cpu"), torch.float32)
    init_random_(model, seed=seed)
    cpu = torch.device("cpu")
    loaded = LoadedModel(model, cfg, None, "t", None, cpu, torch.float32, "t")  # type: ignore[arg-type]
    return ModelRunner(loaded, num_blocks=128, block_size=block_size)
