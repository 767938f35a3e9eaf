"""The scheduler and batched worker, end to end on the demo model (CPU)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import QueueFullError, Request


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def engine(loaded: LoadedModel, **kw: object) -> Engine:
    kw.setdefault("kv_device_gb", 0.05)  # 12k tokens of demo KV: plenty, and fast to allocate
    return Engine(EngineConfig(**kw), loaded=loaded)  # type: ignore[arg-type]


def prompts(loaded: LoadedModel, n: int) -> list[str]:
    tok = loaded.tokenizer
    out = []
    for i in range(n):
        body = " ".join(f"line {j} of file {i}" for j in range(3 + 5 * i))  # lengths vary
        out.append(tok.apply_chat_template([{"role": "user", "content": body}]))
    return out


def run_all(e: Engine, reqs: list[Request]) -> list[tuple[str, list[int], str | None]]:
    streams = [e.submit(r) for r in reqs]
    results = []
    for s in streams:
        text, ids, final = s.collect(timeout=120)
        assert final.error is None, final.error
        results.append((text, ids, final.finish_reason))
    return results


def solo_runs(loaded: LoadedModel, reqs: list[Request]) -> list[tuple[str, list[int], str | None]]:
    e = engine(loaded, max_batch_size=1)
    try:
        return [run_all(e, [r])[0] for r in reqs]
    finally:
        e.close()


def make_reqs(loaded: LoadedModel, n: int, sampling: SamplingParams, tag: str) -> list[Request]:
    return [
        Request(session_id=f"{tag}{i}", prompt_text=p, max_tokens=12 + i, sampling=sampling)
        for i, p in enumerate(prompts(loaded, n))
    ]


SAMPLINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=5),
}


@pytest.fixture(scope="module")
def alone(loaded: LoadedModel) -> dict[str, list[tuple[str, list[int], str | None]]]:
    """Each of the 16 requests run by itself, once per sampling mode."""
    return {k: solo_runs(loaded, make_reqs(loaded, 16, v, "a")) for k, v in SAMPLINGS.items()}


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("mode", sorted(SAMPLINGS))
def test_batched_equals_solo(
    loaded: LoadedModel, alone: dict[str, list], chunked: bool, mode: str
) -> None:
    reqs = make_reqs(loaded, 16, SAMPLINGS[mode], "b")
    e = engine(loaded, max_batch_tokens=24 if chunked else 4096)
    try:
        together = run_all(e, reqs)
        assert e.worker.steps < sum(len(ids) for _, ids, _ in together)  # it did batch
    finally:
        e.close()
    assert [ids for _, ids, _ in together] == [ids for _, ids, _ in alone[mode]]
    assert [t for t, _, _ in together] == [t for t, _, _ in alone[mode]]


def test_long_prompt_is_chunked_while_others_decode(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    long_prompt = tok.apply_chat_template(
        [{"role": "user", "content": " ".join(f"word{i}" for i in range(700))}]
    )
    steps_seen: list[tuple[int, int]] = []

    e = engine(loaded, max_batch_tokens=64)
    e.scheduler.observer.step = lambda b, n, s, *_: steps_seen.append((b, n))  # type: ignore[method-assign]
    try:
        short = e.submit(
            Request(session_id="short", prompt_text=prompts(loaded, 1)[0], max_tokens=40)
        )
        short.get(timeout=60)  # decoding has started
        long = e.submit(Request(session_id="long", prompt_text=long_prompt, max_tokens=4))
        _, ids, final = long.collect(timeout=120)
        assert final.usage is not None and final.usage.prompt_tokens > 64 * 5
        short.collect(timeout=120)
    finally:
        e.close()
    assert max(n for _, n in steps_seen) <= 64  # never a step over the token budget
    mixed = [b for b, n in steps_seen if b == 2]
    assert len(mixed) >= 5  # the short request decoded in the same steps as the chunks


def test_prefill_is_capped_only_while_others_decode(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    long_prompt = tok.apply_chat_template(
        [{"role": "user", "content": " ".join(f"word{i}" for i in range(300))}]
    )
    steps_seen: list[tuple[int, int]] = []  # (sequences, tokens) per step
    # the token cap alone (the work caps: tests/unit/test_prefill_chunks.py)
    e = engine(loaded, max_batch_tokens=256, max_prefill_tokens=32, prefill_decode_ratio=0)
    e.scheduler.observer.step = lambda b, n, s, *_: steps_seen.append((b, n))  # type: ignore[method-assign]
    try:
        # alone, a prompt takes the whole max_batch_tokens budget in its first step
        e.submit(Request(session_id="lone", prompt_text=long_prompt, max_tokens=1)).collect(60)
        assert steps_seen[0] == (1, 256)
        steps_seen.clear()
        short = e.submit(
            Request(session_id="short", prompt_text=prompts(loaded, 1)[0], max_tokens=12)
        )
        short.get(timeout=60)  # decoding has started
        # another text: the lone prompt's blocks are cached and would be shared
        other = long_prompt.replace("word", "term")
        long = e.submit(Request(session_id="long", prompt_text=other, max_tokens=2))
        _, _, final = long.collect(timeout=120)
        assert final.usage is not None and final.usage.prompt_tokens > 256
        assert final.usage.cached_tokens == 0
        short.collect(timeout=120)
    finally:
        e.close()
    mixed = [n for b, n in steps_seen if b == 2]
    assert len(mixed) >= 5  # the prompt was prefilled next to the decoder, in many steps
    assert max(mixed) == 1 + 32  # one decode token + at most max_prefill_tokens of prompt
    # once the decoder finished, the rest of the prompt went at the full budget again
    assert (1, 256) in steps_seen


def test_eos_stop_strings_and_max_tokens(loaded: LoadedModel) -> None:
    e = engine(loaded)
    try:
        p = prompts(loaded, 1)[0]
        [(text, ids, reason)] = run_all(e, [Request(prompt_text=p, max_tokens=10)])
        assert reason == "length" and len(ids) == 10
        stop = text[3:6]  # a stop string taken from the greedy output
        [(cut, _, reason)] = run_all(e, [Request(prompt_text=p, max_tokens=10, stop=(stop,))])
        assert reason == "stop" and cut == text[: text.index(stop)]
        eos = loaded.tokenizer.eos_token_ids[0]
        [(_, ids2, _)] = run_all(e, [Request(prompt_ids=[5, 6, 7], max_tokens=3)])
        assert eos not in ids2
    finally:
        e.close()


def test_failed_step_fails_its_batch_and_rolls_back(loaded: LoadedModel) -> None:
    reqs = make_reqs(loaded, 4, SamplingParams(temperature=0.0), "f")
    follow = [
        Request(session_id=r.session_id, prompt_text=r.prompt_text, max_tokens=8) for r in reqs
    ]
    # Reference: the follow-up turns on sessions that never failed
    ref_engine = engine(loaded)
    try:
        run_all(
            ref_engine,
            [
                Request(session_id=r.session_id, prompt_text=r.prompt_text, max_tokens=1)
                for r in reqs
            ],
        )
        reference = run_all(ref_engine, follow)
    finally:
        ref_engine.close()

    e = engine(loaded)
    real_step = e.runner.step
    calls = {"n": 0}

    def flaky(seqs, return_logits=False):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("CUDA out of memory (injected)")
        return real_step(seqs, return_logits)

    try:
        run_all(
            e,
            [
                Request(session_id=r.session_id, prompt_text=r.prompt_text, max_tokens=1)
                for r in reqs
            ],
        )
        calls["n"] = 0
        e.runner.step = flaky  # type: ignore[method-assign]
        streams = [e.submit(r) for r in follow]
        finals = [s.collect(timeout=60)[2] for s in streams]
        assert all(f.finish_reason == "error" for f in finals)
        assert "out of memory" in (finals[0].error or "")
        e.pool.check_integrity()
        # the next steps run normally and the sessions behave as if nothing happened
        again = run_all(e, follow)
        assert again == reference
    finally:
        e.close()


def test_cancel_frees_the_slot_at_the_next_step(loaded: LoadedModel) -> None:
    e = engine(loaded, max_batch_size=1)
    try:
        p = prompts(loaded, 2)
        first = e.submit(Request(session_id="c1", prompt_text=p[0], max_tokens=500))
        second = e.submit(Request(session_id="c2", prompt_text=p[1], max_tokens=3))
        first.get(timeout=60)
        with pytest.raises(TimeoutError):
            second.get(timeout=0.3)  # the single slot is taken
        first.cancel()
        _, _, final = first.collect(timeout=60)
        assert final.finish_reason == "cancelled"
        assert second.collect(timeout=60)[2].finish_reason == "length"
        # the cancelled session kept what it had computed
        info = e.pool.get("default", "c1")
        assert info is not None and info.num_computed > 0
    finally:
        e.close()


def test_admission_limits_refuse_at_once(loaded: LoadedModel) -> None:
    e = engine(loaded, max_waiting=3, max_waiting_per_tenant=2, max_batch_size=1)
    try:
        p = prompts(loaded, 1)[0]
        with e.worker.engine_lock:  # hold the device: nothing leaves the queue
            e.submit(Request(tenant="a", session_id="x1", prompt_text=p, max_tokens=2))
            time.sleep(0.2)  # the worker admits x1 and blocks on the engine lock
            e.submit(Request(tenant="a", session_id="x2", prompt_text=p, max_tokens=2))
            e.submit(Request(tenant="a", session_id="x3", prompt_text=p, max_tokens=2))
            t0 = time.monotonic()
            with pytest.raises(QueueFullError) as per_tenant:
                e.submit(Request(tenant="a", session_id="x4", prompt_text=p, max_tokens=2))
            assert per_tenant.value.reason == "tenant_queue_full"
            e.submit(Request(tenant="b", session_id="y1", prompt_text=p, max_tokens=2))
            with pytest.raises(QueueFullError) as total:
                e.submit(Request(tenant="c", session_id="z1", prompt_text=p, max_tokens=2))
            assert total.value.reason == "queue_full" and total.value.retry_after > 0
            assert time.monotonic() - t0 < 0.5  # refused at once, not queued
    finally:
        e.close()


def test_tight_budget_admits_what_fits_instead_of_preempting(loaded: LoadedModel) -> None:
    reqs = make_reqs(loaded, 6, SamplingParams(temperature=0.0), "p")
    alone = solo_runs(loaded, make_reqs(loaded, 6, SamplingParams(temperature=0.0), "q"))
    per_block = loaded.config.kv_bytes_per_token(4) * 16
    # room for ~two requests' KV at a time: the rest wait in the queue
    e = engine(loaded, kv_device_gb=28 * per_block / (1 << 30), max_batch_tokens=4096)
    preempted, batch = [], []
    e.scheduler.observer.preempted = lambda: preempted.append(1)  # type: ignore[method-assign]
    e.scheduler.observer.step = lambda b, n, s, *_: batch.append(b)  # type: ignore[method-assign]
    try:
        together = run_all(e, reqs)
        e.pool.check_integrity()
    finally:
        e.close()
    print(f"preemptions: {len(preempted)}, largest batch: {max(batch)}")
    assert len(preempted) <= len(reqs)  # at most one per request (was 27 per request)
    assert max(batch) >= 2  # still batched: what fits runs together
    assert [ids for _, ids, _ in together] == [ids for _, ids, _ in alone]


def test_higher_priority_preempts_and_results_stay_exact(loaded: LoadedModel) -> None:
    greedy = SamplingParams(temperature=0.0)
    p_low, p_high = prompts(loaded, 8)[0], prompts(loaded, 8)[7]  # 25 and ~250 tokens

    def reqs(tag: str) -> list[Request]:
        return [
            Request(session_id=f"{tag}l", prompt_text=p_low, max_tokens=300, sampling=greedy),
            Request(session_id=f"{tag}h", prompt_text=p_high, max_tokens=12, sampling=greedy,
                    priority=-5),
        ]  # fmt: skip

    alone = solo_runs(loaded, reqs("solo"))
    per_block = loaded.config.kv_bytes_per_token(4) * 16
    e = engine(loaded, kv_device_gb=20 * per_block / (1 << 30))  # not enough for both
    preempted: list[int] = []
    started = threading.Event()
    e.scheduler.observer.preempted = lambda: preempted.append(1)  # type: ignore[method-assign]
    e.scheduler.observer.token = lambda seq, first, s: started.set()  # type: ignore[method-assign]
    low, high = reqs("run")
    try:
        low_stream = e.submit(low)
        assert started.wait(60)
        time.sleep(0.3)  # low decodes and grows
        together = run_all(e, [high])
        _, low_ids, final = low_stream.collect(timeout=120)
        assert final.error is None
        e.pool.check_integrity()
    finally:
        e.close()
    assert preempted, "the urgent request had to take the low one's blocks"
    assert together[0][1] == alone[1][1] and low_ids == alone[0][1]


def test_no_batching_runs_one_request_at_a_time(loaded: LoadedModel) -> None:
    e = engine(loaded, no_batching=True)
    sizes: list[int] = []
    e.scheduler.observer.step = lambda b, n, s, *_: sizes.append(b)  # type: ignore[method-assign]
    try:
        run_all(e, make_reqs(loaded, 4, SamplingParams(temperature=0.0), "n"))
        assert set(sizes) == {1}
        assert len(e.pool.list_sessions(tier="device")) == 1  # one live session on the device
    finally:
        e.close()


def test_a_second_request_for_a_busy_session_waits_its_turn(loaded: LoadedModel) -> None:
    e = engine(loaded)
    try:
        p = prompts(loaded, 1)[0]
        a = e.submit(Request(session_id="same", prompt_text=p, max_tokens=30))
        b = e.submit(Request(session_id="same", prompt_text=p, max_tokens=5))
        _, _, fa = a.collect(timeout=60)
        _, _, fb = b.collect(timeout=60)
        assert fa.finish_reason == "length" and fb.finish_reason == "length"
        assert fb.usage is not None and fb.usage.cached_tokens > 0  # ran after a, reusing it
    finally:
        e.close()


def test_submit_from_many_threads(loaded: LoadedModel) -> None:
    e = engine(loaded)
    results: dict[int, str | None] = {}
    p = prompts(loaded, 1)[0]

    def client(i: int) -> None:
        s = e.submit(Request(session_id=f"t{i}", prompt_text=p, max_tokens=6))
        results[i] = s.collect(timeout=60)[2].finish_reason

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        e.close()
    assert results == {i: "length" for i in range(12)}


def test_a_request_that_waits_for_admission_computes_the_same_tokens(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second turn that does not fit at first (its session matched, then released while
    it waits) must run on exactly the tokens it would have run on without waiting: the
    session's reply tokens as sampled plus the new text, not a re-tokenization."""
    from ds4pool.kv.blocks import OutOfBlocksError
    from ds4pool.sched import admission as admission_mod

    tok = loaded.tokenizer
    greedy = SamplingParams(temperature=0.0)
    first = prompts(loaded, 3)[2]

    def turns(e: Engine, sid: str, wait: bool) -> list[tuple[int, list[int]]]:
        computed: list[tuple[int, list[int]]] = []
        add = e.scheduler._add

        def record(step, seq, n):  # type: ignore[no-untyped-def]
            add(step, seq, n)
            if step.inputs and step.seqs[-1] is seq and seq.req.session_id == sid:
                computed.append((step.inputs[-1].num_computed, list(step.inputs[-1].token_ids)))

        e.scheduler._add = record  # type: ignore[method-assign]
        text, _, _ = run_all(e, [Request(session_id=sid, prompt_text=first, max_tokens=24,
                                         sampling=greedy)])[0]  # fmt: skip
        second = (
            first
            + text
            + tok.apply_chat_template([{"role": "user", "content": "and now the next file"}])
        )
        req = Request(session_id=sid, prompt_text=second, max_tokens=8, sampling=greedy)
        refused: list[int] = []
        take = admission_mod.Room.take

        def take_once(room, seq):  # type: ignore[no-untyped-def]
            if wait and seq.req is req and not refused:
                refused.append(1)
                raise OutOfBlocksError("waits (test)")
            take(room, seq)

        monkeypatch.setattr(admission_mod.Room, "take", take_once)
        run_all(e, [req])
        assert refused == ([1] if wait else [])
        return computed

    runs = []
    for wait in (False, True):  # one engine each: the block index would share turn 1
        e = engine(loaded)
        try:
            runs.append(turns(e, "s", wait))
            e.pool.check_integrity()
        finally:
            e.close()
    straight, waited = runs
    assert waited == straight
