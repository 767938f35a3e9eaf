"""The embedded demo model and the random presets used by benchmarks.

`demo` is a tiny Llama-architecture model with deterministic random weights and a
byte-level BPE tokenizer. It is written once as a real Hugging Face directory in the
cache dir and then loaded by the same loader as any checkpoint, so the whole pipeline
(config, safetensors, tokenizer, chat template, eos ids) is exercised by default.

`random:<preset>` builds a model of a realistic shape directly on the device with
random weights (no files): for measuring speed, not for reading its output.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ds4pool.errors import ModelLoadError
from ds4pool.model.config import ModelConfig
from ds4pool.model.demo_tokenizer import build_demo_tokenizer
from ds4pool.model.llama import LlamaForCausalLM
from ds4pool.model.loader import LoadedModel, build_empty, tokenizer_identity
from ds4pool.model.tokenizer import Tokenizer

DEMO_VERSION = 2
DEMO_SEED = 1234
# Wide enough init that greedy output varies from token to token (at 0.02 a model this
# small repeats one token forever, which would make batching tests unable to fail).
DEMO_INIT_STD = 0.1

# Hugging Face config.json fields (vocab, bos and eos are filled from the tokenizer).
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "hidden_act": "silu",
}

PRESETS: dict[str, dict[str, Any]] = {
    # ~100M parameters: a CPU benchmark model.
    "100m": {
        "vocab_size": 32000,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    # Shaped like Meta-Llama-3-8B (8.0B parameters, GQA 32/8, 128k vocab, llama3 RoPE).
    "llama3-8b": {
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "rope_theta": 500000.0,
    },
    # A small Qwen3-MoE (32 experts of width 128, top-4, every layer sparse; 73M parameters,
    # 29M active per token of which 16M the tied embedding): the CPU check of the MoE bench.
    "qwen3-moe-70m": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
    },
    # Shaped like Qwen3-30B-A3B (30.5B parameters, 3.3B active: 48 layers, 128 experts of
    # width 768, top-8, GQA 32/4 with head_dim 128, q/k norms).
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
}


def default_cache_dir() -> Path:
    env = os.environ.get("DS4POOL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "ds4pool"


def init_random_(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic init, independent of parameter order: each tensor draws from its
    own generator seeded by (seed, name). Norm weights 1, biases 0, the rest N(0, std)."""
    device = next(model.parameters()).device
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith(".bias"):
            param.data.zero_()
        else:
            digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
            gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little"))
            param.data.normal_(0.0, std, generator=gen)


def _write_demo(directory: Path) -> None:
    info = build_demo_tokenizer(directory)
    hf_config = dict(
        DEMO_CONFIG,
        vocab_size=info.vocab_size,
        bos_token_id=info.bos_token_id,
        eos_token_id=list(info.eos_token_ids),
        pad_token_id=info.pad_token_id,
    )
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    generation = {"bos_token_id": info.bos_token_id, "eos_token_id": list(info.eos_token_ids)}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    cfg = ModelConfig.from_hf(hf_config)
    model = build_empty(cfg, torch.device("cpu"), torch.float32)
    init_random_(model, DEMO_SEED, DEMO_INIT_STD)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Return the demo model directory, writing it on first use (atomically: a
    concurrent first use by another process either wins the rename or reuses its result)."""
    root = cache_dir or default_cache_dir()
    target = root / f"demo-v{DEMO_VERSION}"
    if (target / "config.json").exists():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=root))
        _write_demo(staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise ModelLoadError(f"cannot write the demo model to {root}: {exc}") from None
    return target


def preset_hf_config(name: str) -> dict[str, Any]:
    """The config.json fields of `random:<preset>` (the demo's, overridden by the preset's)."""
    preset = name.removeprefix("random:")
    if preset not in PRESETS:
        raise ModelLoadError(
            f"unknown random preset {name!r}; available: "
            + ", ".join(f"random:{p}" for p in PRESETS)
        )
    return {**DEMO_CONFIG, "head_dim": None, **PRESETS[preset]}


def preset_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf(preset_hf_config(name))


def load_random_preset(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    cache_dir: Path | None = None,
    tokenizer_dir: Path | None = None,
) -> LoadedModel:
    """A preset-shaped model initialised on `device`. The tokenizer is `tokenizer_dir`'s (the
    vocabulary follows it, eos from it) or the demo model's (ids beyond its vocabulary decode
    to nothing)."""
    cfg = preset_config(name)
    weights_key = f"{name}:{DEMO_SEED}"
    if tokenizer_dir is None:
        tokenizer = Tokenizer.from_dir(ensure_demo_model(cache_dir))
    else:
        tokenizer = Tokenizer.from_dir(tokenizer_dir)
        cfg = replace(cfg, vocab_size=tokenizer.vocab_size, eos_token_ids=tokenizer.eos_token_ids)
        weights_key += ":" + tokenizer_identity(tokenizer_dir)
    model = build_empty(cfg, device, dtype)
    init_random_(model, DEMO_SEED)
    model.fuse_projections()
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=tokenizer,
        name=name,
        path=None,
        device=device,
        dtype=dtype,
        weights_id=hashlib.sha256(weights_key.encode()).hexdigest()[:32],
    )
