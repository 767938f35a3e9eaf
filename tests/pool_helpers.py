"""A single turn through SessionPool + ModelRunner, as the scheduler will drive it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ds4pool.engine import fingerprint_for
from ds4pool.kv.pool import DeviceKV, PoolConfig, PoolObserver, SessionLease, SessionPool
from ds4pool.model.loader import LoadedModel
from ds4pool.model.runner import ModelRunner, SeqInput


@dataclass
class Turn:
    logits: torch.Tensor  # next-token logits after the prompt [V]
    num_reused: int
    num_computed: int  # prompt tokens computed this turn
    token_ids: list[int]


def device_kv(runner: ModelRunner) -> DeviceKV:
    return DeviceKV(runner.kv_caches, runner.layout)


def make_pool(
    loaded: LoadedModel,
    runner: ModelRunner,
    disk_dir: Path | None = None,
    observer: PoolObserver | None = None,
    **kw: object,
) -> SessionPool:
    cfg = PoolConfig(
        num_device_blocks=runner.num_blocks,
        block_size=runner.block_size,
        disk_dir=disk_dir,
        **kw,  # type: ignore[arg-type]
    )
    return SessionPool(cfg, device_kv(runner), fingerprint_for(loaded), observer)


def turn(
    pool: SessionPool,
    runner: ModelRunner,
    s: SessionLease,
    *,
    prompt_ids: list[int] | None = None,
    prompt_text: str | None = None,
    chunk: int = 10_000,
) -> Turn:
    """Match the prompt, restore, prefill what is new (in chunks), commit the prompt."""
    tokenize = None
    if prompt_text is not None:
        tok = runner.loaded.tokenizer

        def tokenize(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

    m = s.prepare(prompt_ids=prompt_ids, prompt_text=prompt_text, tokenize=tokenize)
    s.restore()
    ids = m.token_ids
    s.reserve(len(ids))
    blocks = s.table().block_ids
    logits = None
    for start in range(m.num_cached, len(ids), chunk):
        piece = ids[start : start + chunk]
        last = start + len(piece) == len(ids)
        out = runner.step([SeqInput(piece, start, blocks, sample=last)], return_logits=last)
        logits = out.logits
    assert logits is not None
    s.commit(ids, prompt_text or "", len(ids))
    return Turn(logits[0], m.num_cached, len(ids) - m.num_cached, ids)
