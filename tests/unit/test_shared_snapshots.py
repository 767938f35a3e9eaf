"""Sessions sharing a system prompt, through the disk tier, on the demo model (CPU): the
shared blocks are written to disk once, a restart resumes every session exactly, and a
restore whose prefix is on the device copies only the rest (counted in bytes)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import ds4pool.kv.tier_restore as tiers_mod
from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.blockstore import BLOCK_SUFFIX
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import Request

GREEDY = SamplingParams(temperature=0.0)
BS = 16


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def engine(loaded: LoadedModel, disk: Path | None, **kw: object) -> Engine:
    kw.setdefault("kv_device_gb", 0.05)
    cfg = EngineConfig(kv_disk_dir=disk, kv_persist_idle_s=0, kv_persist_every_tokens=0, **kw)
    return Engine(cfg, loaded=loaded)  # type: ignore[arg-type]


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def run(e: Engine, prompt: list[int], sid: str | None) -> tuple[list[int], int]:
    req = Request(tenant="t", session_id=sid, prompt_ids=prompt, max_tokens=6, sampling=GREEDY)
    _, out, final = e.submit(req).collect(timeout=120)
    assert final.error is None and final.usage is not None, final.error
    e.pool.check_integrity()
    return out, final.usage.cached_tokens


def cold(loaded: LoadedModel, prompt: list[int]) -> list[int]:
    e = engine(loaded, None)
    try:
        return run(e, prompt, None)[0]
    finally:
        e.close()


def test_a_shared_system_prompt_is_written_once_and_resumes_exactly(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    system = ids(0, 6 * BS + 5)  # six full shared blocks
    prompts = {f"s{i}": system + ids(10 + i, 7 + i) for i in range(4)}
    e = engine(loaded, tmp_path)
    try:
        outs = {sid: run(e, p, sid)[0] for sid, p in prompts.items()}
        assert e.pool.flush() == 4
        disk = e.pool.disk
        assert disk is not None
        session_bytes, block_bytes = disk.used_bytes - disk.block_bytes, disk.block_bytes
        per_token = e.pool.kv_bytes_per_token
    finally:
        e.close()
    block_files = sorted(tmp_path.glob(f"*{BLOCK_SUFFIX}"))
    assert len(block_files) == 6  # once, not once per session
    assert block_bytes >= 6 * BS * per_token * 0.5  # the prefix's KV is there (lz4 ~1)
    assert session_bytes < 4 * 6 * BS * per_token * 0.5  # and in no session file

    e = engine(loaded, tmp_path)  # restart: every session's next turn reuses all it had
    try:
        for sid, p in prompts.items():
            nxt = p + outs[sid] + ids(50, 4)
            out, cached = run(e, nxt, sid)
            assert cached == len(p) + len(outs[sid]) - 1
            assert out == cold(loaded, nxt)
    finally:
        e.close()


class CountingScatter:
    """Wraps transfer.scatter_from_host as tier_restore.py calls it: counts the bytes copied."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        self._real = tiers_mod.scatter_from_host
        monkeypatch.setattr(tiers_mod, "scatter_from_host", self)

    def __call__(self, kv, host, blocks, num_tokens):  # noqa: ANN001, ANN204
        self.bytes += num_tokens * kv.layout.bytes_per_token
        return self._real(kv, host, blocks, num_tokens)


@pytest.mark.parametrize("cached", [True, False], ids=["own-blocks-cached", "own-blocks-gone"])
@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_restore_copies_only_what_the_device_lacks(
    loaded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str, cached: bool
) -> None:
    system = ids(1, 6 * BS)
    a, b = system + ids(2, 20), system + ids(3, 9)
    e = engine(loaded, tmp_path)
    try:
        out_a, _ = run(e, a, "a")
        run(e, b, "b")  # b holds the system prompt's blocks on the device
        e.pool.evict("t", "a", tier)
        if not cached:
            e.pool.drop_cached_blocks()  # a's own full blocks; b holds the system prompt's
        counted = CountingScatter(monkeypatch)
        a2 = a + out_a + ids(4, 3)
        out_a2, reused = run(e, a2, "a")
        per_token = e.pool.kv_bytes_per_token
    finally:
        e.close()
    had = len(a) + len(out_a) - 1  # tokens with KV when a was evicted
    # the system prompt's blocks (b's) and, while the index keeps them, a's own full blocks
    # are still on the device: only the rest is copied
    on_device = had - had % BS if cached else 6 * BS
    assert reused == had
    assert counted.bytes == (had - on_device) * per_token
    assert out_a2 == cold(loaded, a2)
