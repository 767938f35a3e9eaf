"""The overlapped loop on CUDA (the default there: overlap "ahead"): launch returns before the
device is done, a steady decode batch's next step is launched before the step before it is
read back (its ids fed on the device, through the CUDA graphs), and the engine's results
equal the synchronous loop's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner, SeqInput
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import Request
from tests.unit.test_overlap import count_fed

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cuda"), torch.bfloat16)


def test_launch_then_wait_equals_step(loaded: LoadedModel) -> None:
    runner = ModelRunner(loaded, num_blocks=64, cuda_graphs="eager")
    seqs = [SeqInput(token_ids=[5 + i, 6, 7, 8], num_computed=0, block_table=[2 * i, 2 * i + 1])
            for i in range(4)]  # fmt: skip
    ref = runner.step(seqs).sampled
    launched = runner.launch(seqs)
    assert launched.event is not None and launched.sampled is not None
    assert launched.sampled.is_pinned()
    assert runner.wait(launched).sampled == ref
    with pytest.raises(AssertionError, match="waited"):
        runner.launch(seqs)
        runner.launch(seqs)  # the first was not waited


def test_prompt_step_launch_does_not_wait_for_the_device(loaded: LoadedModel) -> None:
    """A step of several prompt chunks runs eagerly; its launch must only queue it. The
    overlapped loop streams step N's tokens once N+1's launch returns: a launch that waited for
    the device (a pageable upload after the forward's kernels did) held every first token a
    whole prompt step back (bench/trace_report.py: 28-35 ms p50 on an H100, 64 agents)."""
    runner = ModelRunner(loaded, num_blocks=64, cuda_graphs="eager")
    seqs = [SeqInput(token_ids=[5 + i, 6, 7, 8], num_computed=0, block_table=[2 * i, 2 * i + 1])
            for i in range(4)]  # fmt: skip
    ref = runner.step(seqs).sampled  # kernels compiled, results to compare
    assert launch_behind_device_work(runner, seqs) == ref


def launch_behind_device_work(runner: ModelRunner, seqs: list[SeqInput]) -> list[int | None]:
    """Launch seqs behind ~1 s of queued device work; asserts the launch returned at once,
    with the device still busy; returns the step's sampled ids."""
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device time queued ahead of the launch
    t0 = time.perf_counter()
    launched = runner.launch(seqs)
    took = time.perf_counter() - t0
    busy = launched.event is not None and not launched.event.query()
    sampled = runner.wait(launched).sampled
    assert busy, f"launch returned after the device finished ({took * 1e3:.0f} ms)"
    assert took < 0.3, f"launch took {took * 1e3:.0f} ms behind ~1 s of queued device work"
    return sampled


def test_decode_launch_with_new_blocks_does_not_wait_for_the_device(loaded: LoadedModel) -> None:
    """A decode step whose block tables grew sends the new ids to the persistent tables
    (TableRows.upload), as ~1 step in 16 per sequence does: from pinned memory, else the copy
    waits for every queued kernel and a step launched ahead of the one before it loses its
    overlap (and a grammar row's or a reordered batch's upload the same)."""
    runner = ModelRunner(loaded, num_blocks=64)  # decode through CUDA graphs
    tables = [[2 * i] for i in range(4)]
    runner.step([SeqInput(list(range(5, 20)), 0, tables[i], seq_id=i + 1, table_epoch=1)
                 for i in range(4)])  # fmt: skip
    runner.step([SeqInput([7], 15, tables[i], seq_id=i + 1, table_epoch=1) for i in range(4)])
    for i, t in enumerate(tables):
        t.append(2 * i + 1)  # position 16 needs a second block: one new id per row
    step = [SeqInput([8], 16, tables[i], seq_id=i + 1, table_epoch=1) for i in range(4)]
    uploaded = runner.batch.uploaded_block_ids
    launch_behind_device_work(runner, step)
    assert runner.batch.uploaded_block_ids == uploaded + 4  # the diff path ran


def run(loaded: LoadedModel, overlap: str, reqs: list[Request]) -> list[tuple]:
    e = Engine(EngineConfig(kv_device_gb=0.2, cuda_graphs="lazy", overlap=overlap), loaded=loaded)
    assert e.worker.overlap is (overlap in ("on", "ahead"))
    fed = count_fed(e)
    try:
        streams = [e.submit(r) for r in reqs]
        out = []
        for s in streams:
            text, ids, final = s.collect(timeout=120)
            assert final.error is None, final.error
            out.append((text, ids, final.finish_reason, final.stop_string))
        e.pool.check_integrity()
        assert (fed[0] > 0) is (overlap == "ahead"), (overlap, fed)
        return out
    finally:
        e.close()


def test_overlap_on_equals_off_on_cuda(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": f"job {i} " * (1 + 3 * i)}])
             for i in range(12)]  # fmt: skip
    sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=3)

    def reqs(stops: list[tuple[str, ...]]) -> list[Request]:
        return [Request(prompt_text=t, max_tokens=16 + i, sampling=sampling, stop=stops[i])
                for i, t in enumerate(texts)]  # fmt: skip

    free = run(loaded, "off", reqs([()] * len(texts)))
    # stop strings from the outputs themselves: found while the next step is in flight
    stops = [(r[0][6:9],) if i % 2 == 0 and len(r[0]) > 9 else () for i, r in enumerate(free)]
    off = run(loaded, "off", reqs(stops))
    assert run(loaded, "on", reqs(stops)) == off
    assert run(loaded, "ahead", reqs(stops)) == off
    assert any(r[3] for r in off)  # some did end on a stop string
    e = Engine(EngineConfig(kv_device_gb=0.2, cuda_graphs="eager"), loaded=loaded)
    try:
        assert e.worker.overlap is True and e.worker.ahead is True  # auto: ahead on CUDA
    finally:
        e.close()


def test_runner_step_fed_on_the_device_through_graphs(loaded: LoadedModel) -> None:
    """The runner-level check of tests/unit/test_overlap.py on CUDA, where the decode steps
    replay CUDA graphs (a 3-row step in the 4-row bucket, then 2 fed rows, reordered) and
    the readbacks of the two steps in flight use the two pinned buffers."""
    from tests.unit.test_overlap import (
        test_runner_step_fed_on_the_device_equals_the_step_from_the_host as fed_equals_host,
    )

    fed_equals_host(loaded)
