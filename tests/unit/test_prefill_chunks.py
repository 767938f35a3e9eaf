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


def capped(**kw: object) -> EngineConfig:
    """A small KV pool and this file's token cap, work cap and K."""
    return EngineConfig(
        kv_device_gb=0.05,
        max_prefill_tokens=TOKEN_CAP,
        max_prefill_cost=BUDGET,
        prefill_cost_scale=SCALE,
        **kw,  # type: ignore[arg-type]
    )


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
    cfg = capped(
        max_batch_tokens=256,
        prefill_decode_ratio=0,  # the absolute work cap alone (the relative one: below)
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
    assert cuda is not None and (cuda.context_scale, cuda.budget) == (4096, 640)
    cpu = prefill_cost(EngineConfig(), torch.device("cpu"))
    assert cpu is not None and cpu.chunk_sizes == ()
    assert prefill_cost(EngineConfig(max_prefill_cost=0), torch.device("cuda")) is None
    with pytest.raises(ValueError, match="max_prefill_cost"):
        EngineConfig(max_prefill_cost=-1)
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="sometimes")


def test_the_relative_budget_is_opt_in_and_cpu_rows_weigh_8() -> None:
    cuda = prefill_cost(EngineConfig(), torch.device("cuda"), (32, 64, 128, 256, 512))
    assert cuda is not None and cuda.decode_ratio == 0
    assert cuda.step_budget([2000] * 16) == cuda.budget == 640  # as before this flag
    cpu = prefill_cost(EngineConfig(), torch.device("cpu"))
    assert cpu is not None and cpu.step_budget([800] * 4) == cpu.budget == 112
    half = prefill_cost(EngineConfig(prefill_decode_ratio=0.5), torch.device("cpu"))
    assert half is not None and (half.decode_ratio, half.decode_row) == (0.5, 8.0)
    assert half.step_budget([800] * 4) < half.budget / 2  # few decoders: a smaller chunk
    on = prefill_cost(EngineConfig(prefill_decode_ratio=1.5), torch.device("cuda"))
    assert on is not None and on.decode_ratio == 1.5
    with pytest.raises(ValueError, match="prefill_decode_ratio"):
        EngineConfig(prefill_decode_ratio=-0.1)


def longest(start: int, work: float, k: int = 4096) -> int:
    """Independent of PrefillCost: the most tokens after start whose cost fits `work`."""
    n, cost = 0, 0.0
    while cost + 1 + (start + n + 1) / k <= work:
        cost, n = cost + 1 + (start + n + 1) / k, n + 1
    return n


@pytest.mark.parametrize("ratio", [1.0, 0.01])
def test_chunks_next_to_decoders_follow_their_work(loaded: LoadedModel, ratio: float) -> None:
    """CPU defaults (K 4096, a decode row = 8 units, token cap 64, work cap 112) with
    --prefill-decode-ratio: next to 3 decoders a prompt's chunks are ~ratio x their work
    (1.0: ~24 units, not the 64 tokens the token cap alone gives); at 0.01 it still advances
    min_chunk (16) tokens a step; alone it takes the whole max_batch_tokens."""
    decoders, length, gen = 3, 600, 2000
    cfg = EngineConfig(kv_device_gb=0.05, max_batch_tokens=256, prefill_decode_ratio=ratio)
    e = Engine(cfg, loaded=loaded)
    steps: list[tuple[int, int]] = []  # (sequences, tokens) per step
    e.scheduler.observer.step = lambda b, n, *_: steps.append((b, n))  # type: ignore[method-assign]
    rng = random.Random(5)
    long_ids = [rng.randrange(4, 200) for _ in range(length)]
    try:
        lone_req = Request(session_id="lone", prompt_ids=long_ids[::-1], max_tokens=1)
        _, _, lone = e.submit(lone_req).collect(timeout=300)
        assert lone.error is None and steps[0] == (1, 256)  # no decoders: the full budget
        streams = [
            e.submit(
                Request(
                    session_id=f"d{i}", prompt_ids=[5, 6, 7 + i], max_tokens=gen, ignore_eos=True
                )
            )
            for i in range(decoders)
        ]
        for s in streams:
            s.get(timeout=60)  # decoding has started
        steps.clear()
        long_req = Request(session_id="long", prompt_ids=long_ids, max_tokens=1)
        _, _, final = e.submit(long_req).collect(timeout=300)
        assert final.error is None and final.usage is not None
        assert final.usage.cached_tokens == 0
        for s in streams:
            s.cancel()
    finally:
        e.close()
    chunks = [n - decoders for b, n in steps if b == decoders + 1]
    assert sum(chunks) == length  # the whole prompt went in next to the decoders
    body = chunks[:-1]  # the last chunk is what was left
    if ratio < 0.1:
        assert body and set(body) == {16}  # the floor: the prompt still advances
        return
    # the decoders' work: 8 units a row at their KV length (3 prompt tokens up to + gen)
    lo = longest(length, ratio * 8 * decoders * (1 + 4 / 4096))
    hi = longest(0, ratio * 8 * decoders * (1 + (3 + gen) / 4096))
    assert body and all(lo <= n <= hi for n in body), (lo, hi, body)
    assert hi < 40  # well under the 64 tokens of the token cap alone


def burst_script(
    loaded: LoadedModel, burst: int, queued: list[int] | None = None
) -> tuple[list[list[tuple[str, int, int]]], list[int]]:
    """One decoder, then a 400-token prompt and five 40-token prompts arriving together,
    under a 64-token / 96-unit cap (K 256). This thread drives the steps; returns every
    step's rows as (session, tokens before the row, tokens in it), and the burst counts the
    scheduler reported (the metric's). `queued`: the requests left in the queue after each
    build."""
    cfg = capped(max_batch_tokens=512, prefill_burst=burst, overlap="off")
    e = Engine(cfg, loaded=loaded)
    e.worker.stop()
    sched = e.scheduler
    steps: list[list[tuple[str, int, int]]] = []
    build = sched.schedule

    def record():  # noqa: ANN202 - Step | None
        step = build()
        if step is not None:
            if queued is not None:
                queued.append(len(sched.queue))
            steps.append(
                [
                    (seq.req.session_id or "", inp.num_computed, n)
                    for seq, n, inp in zip(step.seqs, step.counts, step.inputs)
                ]
            )
        return step

    sched.schedule = record  # type: ignore[method-assign]
    bursts: list[int] = []
    sched.observer.prefill_burst = bursts.append  # type: ignore[method-assign]
    rng = random.Random(11)
    try:
        dec = sched.submit(
            Request(session_id="dec", prompt_ids=[5, 6, 7, 8], max_tokens=500, ignore_eos=True)
        )
        for _ in range(3):  # its prompt, then it decodes
            e.worker.step_once()
        long_ = sched.submit(
            Request(
                session_id="long",
                prompt_ids=[rng.randrange(4, 200) for _ in range(400)],
                max_tokens=1,
            )
        )
        shorts = [
            sched.submit(
                Request(
                    session_id=f"s{i}",
                    prompt_ids=[rng.randrange(4, 200) for _ in range(40)],
                    max_tokens=1,
                )
            )
            for i in range(5)
        ]
        steps.clear()
        if queued is not None:
            queued.clear()
        for _ in range(30):  # the decoder goes on; the prompts need ~12 steps at most
            e.worker.step_once()
        for s in (long_, *shorts):
            _, _, final = s.collect(timeout=10)
            assert final.error is None, final.error
        dec.cancel()
    finally:
        e.close()
    return steps, bursts


def test_a_burst_of_short_prompts_starts_together_and_a_long_one_keeps_its_pace(
    loaded: LoadedModel,
) -> None:
    """--prefill-burst 3: the five short prompts start within two steps next to the
    decoder instead of waiting behind the long prompt (which came first and, without the
    burst, takes the whole cap every step); the long prompt's chunks are the same either
    way, and no step holds more than 3 x the caps of prompt work."""
    (plain, none), (burst, counted) = burst_script(loaded, 1), burst_script(loaded, 3)
    # the first step: the long prompt's 64 tokens fill the single token cap, three short
    # prompts go into the burst room; the second: the last two (so the metric counts 5)
    assert none == [] and counted == [3, 2]

    def ended(steps: list[list[tuple[str, int, int]]], sid: str) -> int:  # its prompt's step
        return max(i for i, rows in enumerate(steps) if any(r[0] == sid for r in rows))

    def chunks(steps: list[list[tuple[str, int, int]]], sid: str) -> list[int]:
        return [n for rows in steps for s, _, n in rows if s == sid]

    shorts = [f"s{i}" for i in range(5)]
    assert chunks(plain, "long") == chunks(burst, "long")  # its pace is unchanged
    assert sum(chunks(burst, "long")) == 400 and max(chunks(burst, "long")) <= TOKEN_CAP
    long_done = ended(plain, "long")
    assert long_done >= 6 and all(ended(plain, s) >= long_done for s in shorts)  # behind it
    assert max(ended(burst, s) for s in shorts) <= 1  # all five within two steps, whole
    assert all(chunks(burst, s) == [40] for s in shorts)
    cost = prefill_cost(
        EngineConfig(max_prefill_cost=BUDGET, prefill_cost_scale=SCALE), torch.device("cpu")
    )
    assert cost is not None
    for rows in burst:
        prompt = [(start, n) for sid, start, n in rows if sid != "dec"]
        assert any(sid == "dec" for sid, _, _ in rows)  # the decoder is in every step
        assert sum(n for _, n in prompt) <= 3 * TOKEN_CAP
        assert sum(cost.cost(start, n) for start, n in prompt) <= 3 * BUDGET


def test_a_build_admits_no_prompt_it_has_no_room_for(loaded: LoadedModel) -> None:
    """Next to a decoder, once a prompt finds no room left in the caps and burst room, the
    prompts behind it stay queued (their session matching would only delay the launch;
    run L: a wave of resumed turns) and are admitted by the builds that have room for them."""
    queued: list[int] = []
    steps, counted = burst_script(loaded, 3, queued)
    assert counted == [3, 2]  # the same steps as when all of them were admitted at once
    first = {sid for sid, _, _ in steps[0]}
    assert first == {"dec", "long", "s0", "s1", "s2"}
    # s3 is admitted and finds no room (its size is known once its session is matched),
    # s4 behind it is not admitted by the first build
    assert queued[0] == 1
    assert {sid for sid, _, _ in steps[1]} >= {"s3", "s4"}
