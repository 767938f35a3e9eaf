"""A tiny random Llama over a real tokenizer's vocabulary (for tests of what the tokenizer
and its chat template decide: tool-call formats, special tokens), cheap enough for CPU."""

from __future__ import annotations

from pathlib import Path

import torch

from ds4pool.model.config import ModelConfig
from ds4pool.model.demo import init_random_
from ds4pool.model.loader import LoadedModel, build_empty
from ds4pool.model.tokenizer import Tokenizer


def tiny_model(tokenizer_dir: Path, vocab_size: int | None = None) -> LoadedModel:
    """`vocab_size` (the lm_head's width) may exceed the tokenizer's, as real checkpoints
    pad it (Qwen3: 151,936 for 151,669 tokens)."""
    tok = Tokenizer.from_dir(tokenizer_dir)
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab_size or tok.vocab_size,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
        }
    )
    model = build_empty(cfg, torch.device("cpu"), torch.float32)
    init_random_(model, seed=11)
    cpu = torch.device("cpu")
    return LoadedModel(model, cfg, tok, "tiny", None, cpu, torch.float32, f"tiny:{tokenizer_dir}")
