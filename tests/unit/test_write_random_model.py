"""bench/write_random_model.py --text-ids-only: a random model whose greedy ids all stream
as text (no UTF-8 fragments, no special or padding ids)."""

from __future__ import annotations

import pytest
import torch

from bench.write_random_model import REPLACEMENT, mute_non_text_ids
from ds4pool.model import demo
from ds4pool.model.config import ModelConfig
from ds4pool.model.loader import build_empty
from ds4pool.model.tokenizer import Tokenizer


def _model(vocab: int, tied: bool) -> torch.nn.Module:
    hf = dict(demo.DEMO_CONFIG, head_dim=None, vocab_size=vocab, tie_word_embeddings=tied)
    hf.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    hf.update(num_attention_heads=4, num_key_value_heads=2)
    model = build_empty(ModelConfig.from_hf(hf), torch.device("cpu"), torch.float32)
    demo.init_random_(model, demo.DEMO_SEED)
    return model


def test_greedy_ids_of_a_muted_model_all_decode_to_text() -> None:
    tok = Tokenizer.from_dir(demo.ensure_demo_model())
    vocab = tok.vocab_size + 64  # padding ids past the tokenizer's decode to nothing
    model = _model(vocab, tied=False)
    before = model.lm_head.weight.clone()
    muted = mute_non_text_ids(model, tok)
    fragments = [i for i in range(tok.vocab_size) if REPLACEMENT in tok.decode([i])]
    assert set(fragments) <= set(muted) and set(range(tok.vocab_size, vocab)) <= set(muted)
    assert len(fragments) > 100  # the demo tokenizer's byte fragments: the case at hand
    kept = sorted(set(range(vocab)) - set(muted))
    assert torch.equal(model.lm_head.weight[kept], before[kept])  # the rest untouched
    hidden = torch.randn(
        4096, model.lm_head.weight.shape[1], generator=torch.Generator().manual_seed(0)
    )
    picked = model.lm_head(hidden).argmax(-1).tolist()
    assert not set(picked) & set(muted)
    # ... and before muting, greedy picked fragments and padding ids as often as any id
    assert set((hidden @ before.T).argmax(-1).tolist()) & set(muted)
    for i in set(picked):
        text = tok.decode([i])
        assert text and REPLACEMENT not in text


def test_a_tied_head_is_refused() -> None:
    tok = Tokenizer.from_dir(demo.ensure_demo_model())
    with pytest.raises(ValueError, match="tied"):
        mute_non_text_ids(_model(tok.vocab_size, tied=True), tok)
