"""The overlapped step loop (sched/worker.py, overlap on): a step's writeback is split around
the next launch; with overlap "ahead" a steady decode batch's next step is also launched
before the step before it is read back, its ids fed on the device (sched/ahead.py). What
users get — tokens, text, finish reasons, usage, sessions — is exactly what the synchronous
loop gives (demo model, CPU)."""

from __future__ import annotations

import dataclasses
import threading
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from ds4pool.engine import Engine, EngineConfig
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.sampler import SamplingParams
from ds4pool.sched.request import Event, Request

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5)


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


MODES = ("off", "on", "ahead")


def engine(loaded: LoadedModel, overlap: str, **kw: object) -> Engine:
    kw.setdefault("kv_device_gb", 0.05)
    e = Engine(EngineConfig(overlap=overlap, **kw), loaded=loaded)  # type: ignore[arg-type]
    assert e.worker.overlap is (overlap in ("on", "ahead"))
    assert e.worker.ahead is (overlap == "ahead")
    return e


def count_fed(e: Engine) -> list[int]:
    """Counts the runner launches fed by the step before them (launched ahead)."""
    fed = [0]
    launch = e.runner.launch

    def probe(*args, **kw):  # type: ignore[no-untyped-def]
        fed[0] += kw.get("feed") is not None
        return launch(*args, **kw)

    e.runner.launch = probe  # type: ignore[method-assign]
    return fed


def prompt(loaded: LoadedModel, i: int) -> str:
    body = " ".join(f"line {j} of file {i}" for j in range(3 + 4 * i))
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": body}])


Result = tuple[str, list[int], str | None, str | None, tuple[int, int, int] | None]


def result(text: str, ids: list[int], final: Event) -> Result:
    u = final.usage
    usage = (u.prompt_tokens, u.cached_tokens, u.completion_tokens) if u else None
    return text, ids, final.finish_reason, final.stop_string, usage


def run_all(e: Engine, reqs: list[Request]) -> list[Result]:
    streams = [e.submit(r) for r in reqs]
    out = []
    for s in streams:
        text, ids, final = s.collect(timeout=120)
        assert final.error is None, final.error
        out.append(result(text, ids, final))
    return out


def both(loaded: LoadedModel, turns: list[list[Request]], **kw: object) -> list[list[Result]]:
    """The same turns (each a list of concurrent requests, run one turn after the other) on
    a synchronous, an overlapped and an ahead engine; asserts they give the same results
    (and that the ahead one did launch steps ahead)."""
    runs = []
    for overlap in MODES:
        e = engine(loaded, overlap, **kw)
        fed = count_fed(e)
        try:
            runs.append([run_all(e, reqs) for reqs in turns])
            e.pool.check_integrity()
        finally:
            e.close()
        assert (fed[0] > 0) is (overlap == "ahead"), (overlap, fed)
    assert runs[1] == runs[0]
    assert runs[2] == runs[0]
    return runs[0]


def reference_texts(loaded: LoadedModel, n: int, sampling: SamplingParams) -> list[str]:
    e = engine(loaded, "off")
    try:
        reqs = [Request(prompt_text=prompt(loaded, i), max_tokens=24, sampling=sampling)
                for i in range(n)]  # fmt: skip
        return [text for text, *_ in run_all(e, reqs)]
    finally:
        e.close()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_many_sessions_stop_strings_max_tokens_and_next_turn(
    loaded: LoadedModel, sampling: SamplingParams
) -> None:
    n = 12
    texts = reference_texts(loaded, n, sampling)
    # every third request ends on a stop string found in its output (in the overlapped loop
    # that is found while its next step runs: it ends after that step, its row discarded)
    stops = [(t[8:11],) if i % 3 == 0 and len(t) > 11 else () for i, t in enumerate(texts)]
    first = [
        Request(session_id=f"s{i}", prompt_text=prompt(loaded, i), max_tokens=10 + i,
                sampling=sampling, stop=stops[i])
        for i in range(n)
    ]  # fmt: skip
    e = engine(loaded, "off")
    try:
        out = run_all(e, first)
    finally:
        e.close()
    followups = [
        Request(session_id=f"s{i}", prompt_text=prompt(loaded, i) + text + " and then?",
                max_tokens=6, sampling=sampling)
        for i, (text, *_) in enumerate(out)
    ]  # fmt: skip
    turns = both(loaded, [first, followups])
    reasons = {r[2] for r in turns[0]}
    assert reasons >= {"stop", "length"}, reasons
    assert any(r[3] for r in turns[0])  # a stop string did end some
    # the next turn found each session's KV: the late finish kept what the sync loop keeps
    assert all(u is not None and u[1] > 0 for *_, u in turns[1])


def test_eos_ends_the_same_in_both_loops(loaded: LoadedModel) -> None:
    texts_ids = []
    e = engine(loaded, "off")
    try:
        texts_ids = run_all(e, [Request(prompt_text=prompt(loaded, 1), max_tokens=20)])
    finally:
        e.close()
    eos = texts_ids[0][1][6]  # a token the model samples: made an end of sequence below
    runs = []
    for overlap in MODES:
        e = engine(loaded, overlap)
        e.scheduler.writeback.eos_ids = frozenset({eos})
        try:
            runs.append(
                run_all(
                    e,
                    [
                        Request(prompt_text=prompt(loaded, 1), max_tokens=20),
                        Request(prompt_text=prompt(loaded, 2), max_tokens=20),
                    ],
                )
            )
        finally:
            e.close()
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert runs[0][0][2] == "stop" and len(runs[0][0][1]) <= 6


def test_preemption_under_a_tight_kv_budget(loaded: LoadedModel) -> None:
    per_block = loaded.config.kv_bytes_per_token(4) * 16
    results = []
    for overlap in MODES:
        e = engine(loaded, overlap, kv_device_gb=20 * per_block / (1 << 30))  # not for both
        preempted: list[int] = []
        e.scheduler.observer.preempted = partial(preempted.append, 1)  # type: ignore[method-assign]
        try:
            low = e.submit(Request(session_id="low", prompt_text=prompt(loaded, 0), max_tokens=300))
            head = low.get(timeout=60)
            time.sleep(0.3)  # low decodes and grows
            high = Request(session_id="high", prompt_text=prompt(loaded, 9), max_tokens=12,
                           priority=-5)  # fmt: skip
            [r_high] = run_all(e, [high])
            _, low_ids, final = low.collect(timeout=120)
            assert final.error is None
            e.pool.check_integrity()
        finally:
            e.close()
        assert preempted, "the urgent request had to take the low one's blocks"
        results.append((list(head.token_ids) + low_ids, r_high))
    assert results[1] == results[0] and results[2] == results[0]


@pytest.mark.parametrize("overlap", ["on", "ahead"])
def test_cancel_mid_stream(loaded: LoadedModel, overlap: str) -> None:
    e = engine(loaded, overlap)
    try:
        other = e.submit(
            Request(session_id="o", prompt_text=prompt(loaded, 2), max_tokens=30, ignore_eos=True)
        )
        first = e.submit(
            Request(session_id="c", prompt_text=prompt(loaded, 1), max_tokens=500, ignore_eos=True)
        )
        head = first.get(timeout=60)
        first.cancel()
        _, rest, final = first.collect(timeout=60)
        ids = list(head.token_ids) + rest
        assert final.finish_reason == "cancelled" and 0 < len(ids) < 500
        _, other_ids, other_final = other.collect(timeout=60)
        assert other_final.finish_reason == "length" and len(other_ids) == 30
        info = e.pool.get("default", "c")
        assert info is not None and info.num_computed > 0  # it kept what it had computed
        e.pool.check_integrity()
    finally:
        e.close()
    # the cancelled stream's tokens are the start of what it would have generated
    ref = engine(loaded, "off")
    try:
        req = Request(prompt_text=prompt(loaded, 1), max_tokens=len(ids), ignore_eos=True)
        [(_, full, *_)] = run_all(ref, [req])
    finally:
        ref.close()
    assert full == ids


@pytest.mark.parametrize("overlap", ["on", "ahead"])
@pytest.mark.parametrize("at", ["launch", "wait"])
def test_a_step_that_raises_fails_its_batch_and_rolls_back(
    loaded: LoadedModel, at: str, overlap: str
) -> None:
    reqs = [Request(session_id=f"f{i}", prompt_text=prompt(loaded, i), max_tokens=8)
            for i in range(4)]  # fmt: skip
    ref = engine(loaded, "off")
    try:
        reference = run_all(ref, reqs)
    finally:
        ref.close()
    # the four arrive in one step (a coalescing window), so the third call is all of theirs
    # whatever the machine's load: two admitted a step late ran on after it (a full suite run)
    e = engine(loaded, overlap, coalesce_us=200_000)
    real = getattr(e.runner, at)
    calls = {"n": 0}

    def flaky(*args, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3 and at == "launch":
            raise RuntimeError("CUDA out of memory (injected)")
        out = real(*args, **kw)
        if calls["n"] == 3:  # a fault the device reports at the sync
            raise RuntimeError("CUDA out of memory (injected)")
        return out

    try:
        setattr(e.runner, at, flaky)
        finals = [s.collect(timeout=60)[2] for s in [e.submit(r) for r in reqs]]
        assert all(f.finish_reason == "error" for f in finals)
        assert "out of memory" in (finals[0].error or "")
        e.pool.check_integrity()
        for r in reqs:  # rolled back: the sessions hold no tokens of the failed turn
            info = e.pool.get("default", r.session_id or "")
            assert info is None or info.num_tokens == 0
        again = run_all(e, reqs)  # and the next turns run as if nothing happened
    finally:
        e.close()
    assert [r[:3] for r in again] == [r[:3] for r in reference]


@pytest.mark.parametrize("overlap", MODES)
def test_deferred_writeback_runs_after_the_next_launch(loaded: LoadedModel, overlap: str) -> None:
    """The ordering probe: with overlap, step k's settle (text, events, offer) comes after
    step k+1's launch; without, before it. Ahead, a decode step k+1 is launched before step
    k is waited (the prompt's step is not: what follows it is built from its results)."""
    e = engine(loaded, overlap)
    log: list[str] = []
    lock = threading.Lock()
    launch, wait, settle = e.runner.launch, e.runner.wait, e.scheduler.settle

    def probe(name, real, *args, **kw):  # type: ignore[no-untyped-def]
        with lock:
            log.append(name)
        return real(*args, **kw)

    e.runner.launch = partial(probe, "launch", launch)  # type: ignore[method-assign]
    e.runner.wait = partial(probe, "wait", wait)  # type: ignore[method-assign]
    e.scheduler.settle = partial(probe, "settle", settle)  # type: ignore[method-assign]
    try:
        [(_, ids, *_)] = run_all(e, [Request(prompt_ids=[5, 6, 7, 8], max_tokens=6,
                                             ignore_eos=True)])  # fmt: skip
    finally:
        e.close()
    assert len(ids) == 6
    # one request: one launch per token (ahead too: max_tokens is known, no step in vain);
    # the last token's settle follows no launch
    assert log.count("launch") == 6, log
    if overlap == "ahead":
        assert log[:7] == ["launch", "wait", "launch", "settle", "launch", "wait", "settle"], log
    elif overlap == "on":
        assert log[:7] == ["launch", "wait", "launch", "settle", "wait", "launch", "settle"], log
    else:
        assert log[:6] == ["launch", "wait", "settle", "launch", "wait", "settle"], log


@pytest.mark.parametrize("overlap", ["on", "ahead"])
def test_a_prompt_step_launch_waits_for_the_settle_before_it(
    loaded: LoadedModel, overlap: str
) -> None:
    """A step that runs a prompt chunk eagerly holds the host for its whole launch (an 8B
    model's dispatch is 10-20 ms on an H100): the step before it is settled first, so its
    tokens (a first token among them) are streamed before, not after, that dispatch. A decode
    step's launch (a graph replay) keeps the deferred order: launch, then settle."""
    e = engine(loaded, overlap)
    log: list[str] = []
    lock = threading.Lock()
    launch, wait, settle = e.runner.launch, e.runner.wait, e.scheduler.settle

    def probe_launch(seqs, *args, **kw):  # type: ignore[no-untyped-def]
        with lock:
            log.append("prompt" if any(len(s.token_ids) > 1 for s in seqs) else "decode")
        return launch(seqs, *args, **kw)

    def probe(name, real, *args, **kw):  # type: ignore[no-untyped-def]
        with lock:
            log.append(name)
        return real(*args, **kw)

    e.runner.launch = probe_launch  # type: ignore[method-assign]
    e.runner.wait = partial(probe, "wait", wait)  # type: ignore[method-assign]
    e.scheduler.settle = partial(probe, "settle", settle)  # type: ignore[method-assign]
    try:
        a = e.submit(Request(prompt_ids=[5, 6, 7, 8], max_tokens=40, ignore_eos=True))
        assert a.get(timeout=60).error is None  # A decodes: B's prompt joins its steps
        b = e.submit(Request(prompt_text=prompt(loaded, 3), max_tokens=4, ignore_eos=True))
        for s in (a, b):
            assert s.collect(timeout=120)[2].error is None
    finally:
        e.close()
    # B's chunk ran next to A's decoding: the step before it was waited, then settled, then
    # B's step launched (deferred, it would be wait, launch, settle)
    joined = [i for i, name in enumerate(log) if name == "prompt" and i > 0]
    assert joined, log
    for i in joined:
        assert log[i - 2 : i] == ["wait", "settle"], (i, log)
    # decode steps keep the deferred order: wait, launch, settle
    decodes = [i for i, name in enumerate(log) if name == "decode" and 0 < i < len(log) - 1]
    assert any(log[i - 1 : i + 2] == ["wait", "decode", "settle"] for i in decodes), log


@pytest.mark.parametrize("overlap", ["on", "ahead"])
def test_no_request_ends_while_a_step_is_in_flight(loaded: LoadedModel, overlap: str) -> None:
    """A stop string found while the next step runs ends its request only after that step's
    sync: no lease is released (no KV freed or moved) under a step that still writes it.
    Ahead, the step in flight may hold other requests, never the one that ends."""
    texts = reference_texts(loaded, 6, GREEDY)
    reqs = [Request(session_id=f"l{i}", prompt_text=prompt(loaded, i), max_tokens=24,
                    stop=(t[6:9],)) for i, t in enumerate(texts)]  # fmt: skip
    e = engine(loaded, overlap)
    in_flight_at_finish: list[bool] = []
    finish = e.scheduler._finish

    def probe(seq, reason, **kw):  # type: ignore[no-untyped-def]
        in_flight_at_finish.append(seq.seq_id in e.worker.in_flight_seqs())
        return finish(seq, reason, **kw)

    e.scheduler._finish = probe  # type: ignore[method-assign]
    e.scheduler.writeback.finish = probe
    try:
        out = run_all(e, reqs)
    finally:
        e.close()
    assert sum(1 for r in out if r[3]) >= 3  # stop strings ended most of them
    assert in_flight_at_finish and not any(in_flight_at_finish)


def test_overlap_flag_env_and_default(monkeypatch: pytest.MonkeyPatch, loaded: LoadedModel) -> None:
    import argparse

    from ds4pool.errors import Ds4poolError
    from ds4pool.serve import add_engine_flags, add_server_flags, build_config

    def serve_config(argv: list[str]):  # noqa: ANN202 - ServerConfig
        p = argparse.ArgumentParser()
        add_engine_flags(p)
        add_server_flags(p)
        return build_config(p.parse_args(argv))

    monkeypatch.delenv("DS4POOL_OVERLAP", raising=False)
    assert serve_config([]).engine.overlap == "auto"
    assert serve_config(["--overlap", "on"]).engine.overlap == "on"
    monkeypatch.setenv("DS4POOL_OVERLAP", "off")
    assert serve_config([]).engine.overlap == "off"
    monkeypatch.setenv("DS4POOL_OVERLAP", "maybe")
    with pytest.raises(Ds4poolError, match="overlap must be one of auto, on, ahead, off"):
        serve_config([])
    e = Engine(EngineConfig(kv_device_gb=0.05), loaded=loaded)  # auto on CPU: off
    try:
        assert e.worker.overlap is False
    finally:
        e.close()


def test_runner_launch_then_wait_is_step(loaded: LoadedModel) -> None:
    from ds4pool.model.runner import ModelRunner, SeqInput

    runner = ModelRunner(loaded, num_blocks=16)
    seqs = [
        SeqInput(token_ids=[5 + i, 6, 7], num_computed=0, block_table=[i], sample=i != 1)
        for i in range(3)
    ]
    ref = runner.step(seqs).sampled
    assert ref[1] is None and ref[0] is not None and ref[2] is not None
    launched = runner.launch(seqs)
    with pytest.raises(AssertionError, match="waited"):
        runner.launch(seqs)  # one step at a time: they share the input batch and readback
    assert runner.wait(launched).sampled == ref
    assert runner.step(seqs).sampled == ref  # waited: the next launch is fine


def test_runner_step_fed_on_the_device_equals_the_step_from_the_host(loaded: LoadedModel) -> None:
    """A decode step launched before the step it follows is read back, its ids fed from that
    step's sampled ids (rows reordered and one dropped, a seeded row whose step index counts
    the fed token), samples what the same step built from the read-back ids samples."""
    from ds4pool.model.runner import ModelRunner, SeqInput

    seeded = SamplingParams(temperature=0.9, seed=11)

    def rows(ids: list[list[int]], done: list[list[int]]) -> list[SeqInput]:
        return [
            SeqInput(token_ids=t, num_computed=n, block_table=[2 * i, 2 * i + 1],
                     sampling=seeded if i == 2 else GREEDY, seed=7, seq_id=i + 1,
                     output_token_ids=done[i])
            for i, (t, n) in enumerate(ids)
        ]  # fmt: skip

    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    results = []
    for ahead in (False, True):
        runner = ModelRunner(loaded, num_blocks=16)
        done: list[list[int]] = [[], [], []]
        out = runner.step(rows([(p, 0) for p in prompts], done)).sampled  # type: ignore[arg-type]
        for d, tok in zip(done, out):
            d.append(tok)  # type: ignore[arg-type]
        step1 = rows([([d[-1]], 4) for d in done], done)  # type: ignore[misc]
        first = runner.launch(step1)
        if ahead:  # rows 2 and 0 go on, from step 1's ids on the device, before its readback
            fed = [
                SeqInput([0], 5, s.block_table, sampling=s.sampling, seed=7, seq_id=s.seq_id,
                         output_token_ids=done[j], fed_from=j)
                for j, s in ((2, step1[2]), (0, step1[0]))
            ]  # fmt: skip
            second = runner.launch(fed, feed=first)
            got1 = runner.wait(first).sampled
            got2 = runner.wait(second).sampled
        else:
            got1 = runner.wait(first).sampled
            for d, tok in zip(done, got1):
                d.append(tok)  # type: ignore[arg-type]
            again = [
                SeqInput([done[j][-1]], 5, step1[j].block_table, sampling=step1[j].sampling,
                         seed=7, seq_id=step1[j].seq_id, output_token_ids=done[j])
                for j in (2, 0)
            ]  # fmt: skip
            got2 = runner.step(again).sampled
        results.append((got1, got2))
    assert results[1] == results[0]
    runner = ModelRunner(loaded, num_blocks=16)
    with pytest.raises(AssertionError, match="feed"):
        runner.launch([SeqInput([0], 0, [0], fed_from=0)])


def test_rows_that_need_their_token_on_the_host_never_go_ahead(loaded: LoadedModel) -> None:
    """A frequency penalty counts every token generated so far, the one a fed row has not
    seen yet too: a batch with such a row is never launched ahead, and gives the
    synchronous loop's tokens (the other rows are greedy, all end together)."""
    penalised = SamplingParams(temperature=0.0, frequency_penalty=1.5)
    reqs = [
        Request(prompt_text=prompt(loaded, i), max_tokens=12, ignore_eos=True,
                sampling=penalised if i == 1 else GREEDY)
        for i in range(3)
    ]  # fmt: skip
    # the three arrive in one step (a coalescing window), so they decode and end together
    # whatever the machine's load: one admitted a step late would decode its last step alone
    burst = 200_000
    runs, fed_counts = [], []
    for overlap in ("off", "ahead"):
        e = engine(loaded, overlap, coalesce_us=burst)
        fed = count_fed(e)
        try:
            runs.append(run_all(e, reqs))
        finally:
            e.close()
        fed_counts.append(fed[0])
    assert runs[1] == runs[0]
    assert fed_counts == [0, 0]
    e = engine(loaded, "ahead", coalesce_us=burst)  # without the penalty it does go ahead
    fed = count_fed(e)
    try:
        run_all(e, [dataclasses.replace(r, sampling=GREEDY) for r in reqs])
    finally:
        e.close()
    assert fed[0] > 0


def test_the_trace_marks_the_prompt_steps_that_ran_eagerly(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    """--trace-steps with the overlapped loop: a prompt step the runner ran op by op (on CPU
    every one: no CUDA graphs) says "eager": 1; decode steps say nothing; every step says
    the step thread's CPU time in its launch call ("cpu")."""
    import json

    path = tmp_path / "steps.jsonl"
    e = engine(loaded, "on", trace_steps=path)
    try:
        run_all(e, [Request(session_id=f"t{i}", prompt_text=prompt(loaded, i), max_tokens=6)
                    for i in range(2)])  # fmt: skip
    finally:
        e.close()
    steps = [json.loads(x) for x in path.read_text().splitlines() if '"t0"' in x]
    prompt_steps = [s for s in steps if s["chunks"]]
    decode_steps = [s for s in steps if not s["chunks"]]
    assert prompt_steps and decode_steps
    assert all(s.get("eager") == 1 for s in prompt_steps)
    assert not any("eager" in s for s in decode_steps)
    # the step thread's CPU time in each launch call, within the call (the forward runs in
    # it on CPU: more than nothing for a prompt step)
    assert all(0 <= s["cpu"] <= s["ret"] - s["t0"] + 0.002 for s in steps)
    assert all(s["cpu"] > 0 for s in prompt_steps)
