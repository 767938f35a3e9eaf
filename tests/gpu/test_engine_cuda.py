"""The engine on a CUDA device: batching, tiers (pinned host copies) and restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.match import common_prefix_len
from ds4pool.kv.transfer import DeviceKV, gather_to_host
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.sched.request import Request

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request: pytest.FixtureRequest, demo_dir: Path) -> LoadedModel:
    dtype = getattr(torch, request.param)
    return load_model(str(demo_dir), torch.device("cuda"), dtype)


def prompts(loaded: LoadedModel, n: int) -> list[str]:
    tok = loaded.tokenizer
    return [
        tok.apply_chat_template([{"role": "user", "content": f"job {i} " * (1 + 3 * i)}])
        for i in range(n)
    ]


def run(e: Engine, reqs: list[Request]) -> list[list[int]]:
    streams = [e.submit(r) for r in reqs]
    out = []
    for s in streams:
        _, ids, final = s.collect(timeout=120)
        assert final.error is None, final.error
        out.append(ids)
    return out


def test_batched_equals_solo_on_cuda(loaded: LoadedModel) -> None:
    def reqs(tag: str) -> list[Request]:
        return [
            Request(session_id=f"{tag}{k}", prompt_text=p, max_tokens=16)
            for k, p in enumerate(prompts(loaded, 16))
        ]

    solo_engine = Engine(
        EngineConfig(kv_device_gb=0.2, cuda_graphs="lazy", max_batch_size=1), loaded=loaded
    )
    try:
        solo = [run(solo_engine, [r])[0] for r in reqs("a")]
    finally:
        solo_engine.close()
    e = Engine(
        EngineConfig(kv_device_gb=0.2, cuda_graphs="lazy", max_batch_tokens=64), loaded=loaded
    )
    try:
        together = run(e, reqs("b"))
    finally:
        e.close()
    if loaded.dtype == torch.float32:
        assert together == solo
    else:
        # bf16: batch shapes round differently, and the demo model's near-tied random logits
        # turn a rounding difference into another greedy token now and then, after which the
        # completion goes its own way (11 of 16 stayed identical on an H100, session 41). A
        # batching fault (another row's KV, a wrong position) shows from the first tokens:
        # the completions must follow their solo run for most of what they generate.
        followed = sum(common_prefix_len(a, b) for a, b in zip(together, solo))
        total = sum(len(b) for b in solo)
        assert followed >= total // 2, (
            f"bf16 completions follow their solo run for {followed} of {total} tokens"
        )


def session_kv(e: Engine, session_id: str) -> torch.Tensor:
    """The session's KV, restored to the device and copied out (through pinned memory)."""
    s = e.pool.acquire("default", session_id)
    try:
        s.restore()
        assert s.session.block_table is not None
        kv = DeviceKV(e.runner.kv_caches, e.runner.layout)
        return gather_to_host(kv, s.session.block_table.blocks, s.session.num_computed)
    finally:
        s.release()


def test_tiers_round_trip_bitwise_on_cuda(loaded: LoadedModel, tmp_path: Path) -> None:
    e = Engine(
        EngineConfig(kv_device_gb=0.2, cuda_graphs="lazy", kv_disk_dir=tmp_path), loaded=loaded
    )
    try:
        p = prompts(loaded, 1)[0]
        run(e, [Request(session_id="s", prompt_text=p, max_tokens=8)])
        reference = session_kv(e, "s")
        assert reference.is_pinned() and reference.shape[2] > 0
        for tier in ("ram", "disk"):
            e.pool.evict("default", "s", tier)
            assert e.pool.get("default", "s").tier == tier  # type: ignore[union-attr]
            assert torch.equal(session_kv(e, "s"), reference), tier
        e.pool.check_integrity()
    finally:
        e.close()


def test_shared_block_files_round_trip_bitwise_on_cuda(loaded: LoadedModel, tmp_path: Path) -> None:
    """Two sessions on one system prompt: its blocks go to block files once (from pinned
    host copies), and a session restored from them has bitwise the KV it had."""
    system = "You are a careful agent. " * 40  # > 8 full blocks of 16 tokens
    tok = loaded.tokenizer
    a, b = (
        tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": u}]
        )
        for u in ("list the files", "run the tests")
    )
    e = Engine(
        EngineConfig(kv_device_gb=0.2, cuda_graphs="lazy", kv_disk_dir=tmp_path), loaded=loaded
    )
    try:
        run(e, [Request(session_id="a", prompt_text=a, max_tokens=8)])
        run(e, [Request(session_id="b", prompt_text=b, max_tokens=8)])
        reference = session_kv(e, "a")
        e.pool.evict("default", "a", "disk")  # b holds the system prompt: block files
        e.pool.evict("default", "b", "disk")
        e.pool.drop_cached_blocks()  # nothing of either is on the device now
        assert len(list(tmp_path.glob("*.blk"))) >= 8
        disk = e.pool.disk
        assert disk is not None and disk.block_bytes > 0
        assert torch.equal(session_kv(e, "a"), reference)
        e.pool.check_integrity()
    finally:
        e.close()
