"""The scheduler chunks a long prompt next to decoders by work: chunks shrink as its context
grows (demo model, CPU, end to end through the engine)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig, prefill_cost
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.sched.request import Request

SCALE, BUDGET, TOKEN_CAP = 256, 96, 64  # a small K so that a 1.2k prompt shows the effect


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def expected_chunks(length: int) -> list[int]:
    """Independent of PrefillCost: the longest chunk (<= the token cap) whose tokens, each
    costing 1 + (position + 1) / K, fit the budget; at least 16 tokens a step."""
    out, start = [], 0
    while start < length:
        n, cost = 0, 0.0
        while n < min(TOKEN_CAP, length - start):
            step = 1 + (start + n + 1) / SCALE
            if cost + step > BUDGET:
                break
            cost, n = cost + step, n + 1
        n = max(n, min(16, length - start))
        out.append(n)
        start += n
    return out


def test_a_long_prompt_next_to_a_decoder_gets_shrinking_chunks(loaded: LoadedModel) -> None:
    cfg = EngineConfig(
        kv_device_gb=0.05,
        max_batch_tokens=256,
        max_prefill_tokens=TOKEN_CAP,
        max_prefill_cost=BUDGET,
        prefill_cost_scale=SCALE,
    )
    e = Engine(cfg, loaded=loaded)
    steps: list[tuple[int, int]] = []  # (sequences, tokens) per step
    e.scheduler.observer.step = lambda b, n, *_: steps.append((b, n))  # type: ignore[method-assign]
    rng = random.Random(3)
    long_ids = [rng.randrange(4, 200) for _ in range(1200)]
    try:
        decoder = e.submit(
            Request(session_id="dec", prompt_ids=[5, 6, 7, 8], max_tokens=2000, ignore_eos=True)
        )
        decoder.get(timeout=60)  # decoding has started
        steps.clear()
        _, _, final = e.submit(
            Request(session_id="long", prompt_ids=long_ids, max_tokens=1)
        ).collect(timeout=300)
        assert final.error is None and final.usage is not None
        assert final.usage.cached_tokens == 0
        decoder.cancel()
    finally:
        e.close()
    chunks = [n - 1 for b, n in steps if b == 2]  # one decode token + the prompt's chunk
    want = expected_chunks(len(long_ids))
    assert chunks[: len(want)] == want
    # what that means: full token-cap chunks at first, then smaller as the context grows
    assert want[0] == TOKEN_CAP and want[-2] < TOKEN_CAP // 2


def test_device_defaults_and_off() -> None:
    cuda = prefill_cost(EngineConfig(), torch.device("cuda"), (32, 64, 128, 256, 512))
    assert cuda is not None and (cuda.context_scale, cuda.budget) == (4096, 896)
    cpu = prefill_cost(EngineConfig(), torch.device("cpu"))
    assert cpu is not None and cpu.chunk_sizes == ()
    assert prefill_cost(EngineConfig(max_prefill_cost=0), torch.device("cuda")) is None
    with pytest.raises(ValueError, match="max_prefill_cost"):
        EngineConfig(max_prefill_cost=-1)
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="sometimes")
