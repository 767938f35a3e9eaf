"""A plain generation loop over the runner: used by `ds4pool generate`, tests and benches.

Prompts are prefilled one by one in chunks, then all sequences decode together, one
forward per step. The server's scheduler does the same work continuously; this loop
is its simplest correct form.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ds4pool.errors import ContextLengthError
from ds4pool.kv.blocks import BlockPool, BlockTable
from ds4pool.model.runner import ModelRunner, SeqInput
from ds4pool.model.sampler import GREEDY, SamplingParams


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (eos) or "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time of the whole decode phase (shared in a batch)


def generate(
    runner: ModelRunner,
    pool: BlockPool,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    sampling: SamplingParams = GREEDY,
    seeds: Sequence[int] | None = None,
    stop_token_ids: Sequence[int] = (),
    chunk_size: int = 512,
) -> list[GenerationResult]:
    """Generate up to max_tokens for each prompt; blocks are returned to `pool` after."""
    limit = runner.max_model_len
    for p in prompts:
        if not p:
            raise ContextLengthError("the prompt is empty")
        if len(p) >= limit:
            raise ContextLengthError(
                f"prompt has {len(p)} tokens; the model's context is {limit} "
                "(the prompt must leave room for at least one generated token)"
            )
    if seeds is None:
        base = sampling.seed if sampling.seed is not None else random.getrandbits(63)
        seeds = [base + i for i in range(len(prompts))]
    results = [GenerationResult(prompt_ids=list(p)) for p in prompts]
    tables = [BlockTable(runner.block_size) for _ in prompts]
    stop = set(stop_token_ids)
    try:
        t0 = time.perf_counter()
        active: list[int] = []
        for i, (prompt, table) in enumerate(zip(prompts, tables)):
            tok = _prefill(runner, pool, table, list(prompt), sampling, seeds[i], chunk_size)
            if _accept(results[i], tok, stop, max_tokens, limit):
                active.append(i)
        t1 = time.perf_counter()
        while active:
            batch = []
            for i in active:
                r = results[i]
                n = len(r.prompt_ids) + len(r.token_ids)
                tables[i].ensure(pool, n)
                batch.append(
                    SeqInput(
                        token_ids=[r.token_ids[-1]],
                        num_computed=n - 1,
                        block_table=tables[i].blocks,
                        sampling=sampling,
                        seed=seeds[i],
                        output_token_ids=r.token_ids,
                        seq_id=i + 1,
                        table_epoch=tables[i].epoch,
                    )
                )
            out = runner.step(batch)
            active = [
                i
                for i, tok in zip(active, out.sampled)
                if _accept(results[i], tok, stop, max_tokens, limit)
            ]
        t2 = time.perf_counter()
    finally:
        for table in tables:
            table.release(pool)
    for r in results:
        r.prefill_seconds, r.decode_seconds = t1 - t0, t2 - t1
    return results


def _prefill(
    runner: ModelRunner,
    pool: BlockPool,
    table: BlockTable,
    prompt: list[int],
    sampling: SamplingParams,
    seed: int,
    chunk_size: int,
) -> int:
    table.ensure(pool, len(prompt))
    tok: int | None = None
    for start in range(0, len(prompt), chunk_size):
        chunk = prompt[start : start + chunk_size]
        last = start + len(chunk) == len(prompt)
        out = runner.step(
            [SeqInput(chunk, start, table.blocks, sample=last, sampling=sampling, seed=seed)]
        )
        tok = out.sampled[0]
    assert tok is not None
    return tok


def _accept(
    r: GenerationResult, tok: int | None, stop: set[int], max_tokens: int, limit: int
) -> bool:
    """Record `tok`; return True while the sequence should keep decoding."""
    assert tok is not None
    if tok in stop:
        r.finish_reason = "stop"
        return False
    r.token_ids.append(tok)
    if len(r.token_ids) >= max_tokens or len(r.prompt_ids) + len(r.token_ids) >= limit:
        r.finish_reason = "length"
        return False
    return True
