"""The transformers peer for bench/decode.py: `generate` with a static KV cache.

What a user who tries plain Hugging Face first gets: greedy `generate` over B prompts with
`StaticCache`, which transformers compiles automatically on CUDA. Decode tok/s is measured
as B * steps / (time(steps + 1 new tokens) - time(1 new token)), each time the median of
`repeats` calls after a warm-up (compilation) call with the same shapes.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def build_model(hf_config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """A transformers LlamaForCausalLM of this config, random weights made on the device."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in hf_config.items() if v is not None})
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def _timed_generate(model: Any, ids: torch.Tensor, new_tokens: int, repeats: int) -> float:
    from transformers import StaticCache

    times = []
    for _ in range(repeats):
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens + 8)
        if ids.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        if ids.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def decode_tok_s(model: Any, batch: int, prompt_len: int, steps: int, repeats: int = 3) -> float:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(model.device)
    _timed_generate(model, ids, steps + 1, 1)  # warm-up: compile for these shapes
    _timed_generate(model, ids, 1, 1)
    t_one = _timed_generate(model, ids, 1, repeats)
    t_all = _timed_generate(model, ids, steps + 1, repeats)
    return batch * steps / max(t_all - t_one, 1e-9)
