"""Token bitmasks in ModelRunner.step: a constrained row obeys its mask, the others in the
same batch sample exactly as they would alone, and a seeded constrained draw is batch-invariant."""

from __future__ import annotations

import pytest
import torch

from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.grammar import apply_token_bitmask, forbidden_tokens
from ds4pool.model.runner import ModelRunner, SeqInput
from ds4pool.model.sampler import GREEDY, SamplingParams
from tests.hf_models import tiny_runner

BLOCK = 8
VOCAB = 300  # 10 words of 32 bits, the last one partly padding
# bit 31 (the sign bit of word 0), a word boundary, and the last real token
ALLOWED = {7, 31, 32, 150, 299}
SAMPLINGS = {
    "greedy": GREEDY,
    "seeded": SamplingParams(temperature=1.0, seed=11),
    "top_k_p": SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=3),
}


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return tiny_runner(VOCAB, seed=5, block_size=BLOCK)


def bitmask(allowed: set[int], vocab: int = VOCAB) -> torch.Tensor:
    words = [0] * ((vocab + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    # int32 words as xgrammar writes them (bit 31 makes the word negative)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19, 11)]


def step(
    runner: ModelRunner,
    rows: list[tuple[list[int], SamplingParams, torch.Tensor | None]],
) -> tuple[list[int], torch.Tensor]:
    pool = BlockPool(runner.num_blocks)
    tables = [BlockTable(BLOCK) for _ in rows]
    inputs = []
    for (ids, sampling, mask), table in zip(rows, tables):
        table.ensure(pool, len(ids))
        inputs.append(
            SeqInput(
                ids, 0, table.blocks, sampling=sampling, seed=sampling.seed or 0, token_bitmask=mask
            )
        )
    out = runner.step(inputs, return_logits=True)
    assert out.logits is not None
    return [t for t in out.sampled if t is not None], out.logits


@pytest.mark.parametrize("mode", sorted(SAMPLINGS))
def test_masked_row_obeys_and_others_are_unchanged(runner: ModelRunner, mode: str) -> None:
    sampling = SAMPLINGS[mode]
    ps = prompts()
    solo = [step(runner, [(p, sampling, None)]) for p in ps]
    mask = bitmask(ALLOWED)
    solo_masked, _ = step(runner, [(ps[1], sampling, mask)])
    rows = [(ps[0], sampling, None), (ps[1], sampling, mask), (ps[2], sampling, None)]
    batch, logits = step(runner, rows)
    unmasked, unmasked_logits = step(runner, [(p, sampling, None) for p in ps])
    # the same batch without the mask: other rows bit for bit the same
    assert torch.equal(logits[0], unmasked_logits[0]) and torch.equal(logits[2], unmasked_logits[2])
    assert [batch[0], batch[2]] == [unmasked[0], unmasked[2]]
    # ...and the same tokens as alone (logits agree to float rounding across batch shapes)
    assert batch[0] == solo[0][0][0] and batch[2] == solo[2][0][0]
    assert batch[1] in ALLOWED
    assert batch[1] == solo_masked[0]  # the constrained draw does not depend on its batch
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert set(finite) == ALLOWED
    if mode == "greedy":  # the best allowed token of the unmasked logits
        free = solo[1][1][0]
        assert batch[1] == max(ALLOWED, key=lambda t: float(free[t]))


def test_seeded_constrained_draws_follow_the_distribution(runner: ModelRunner) -> None:
    """Many seeds through one masked row: every draw allowed, and more than one token drawn
    (the mask restricts the distribution, it does not make it greedy)."""
    p = prompts()[0]
    mask = bitmask(ALLOWED)
    seen = set()
    for seed in range(12):
        tokens, _ = step(runner, [(p, SamplingParams(temperature=5.0, seed=seed), mask)])
        seen.add(tokens[0])
    assert seen <= ALLOWED and len(seen) > 1


def test_apply_bitmask_on_padded_vocab() -> None:
    """Logits wider than the tokenizer (a padded lm_head): ids past the mask's set bits are
    never allowed, and rows not listed are untouched."""
    logits = torch.randn(3, 70)
    before = logits.clone()
    out = apply_token_bitmask(logits, [2], [bitmask({0, 64}, vocab=70)])
    assert torch.equal(logits, before)  # the input is not modified
    assert torch.equal(out[:2], before[:2])
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0, 64]


def test_device_path_agrees_with_xgrammar_kernel() -> None:
    """The tensor-op path CUDA uses gives the mask xgrammar's CPU kernel gives."""
    xgr = pytest.importorskip("xgrammar")
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (4, 10), dtype=torch.int32, generator=g)
    logits = torch.randn(4, VOCAB, generator=g)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, words, vocab_size=VOCAB)
    ours = logits.masked_fill(forbidden_tokens(words, VOCAB), float("-inf"))
    assert torch.equal(ours, reference)
