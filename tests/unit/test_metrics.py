"""Metrics move as the engine works: a scripted workload on a real Engine (demo model, CPU)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ds4pool.engine import Engine, EngineConfig
from ds4pool.kv.cost import CostPriors
from ds4pool.kv.disk_hooks import ERROR_KINDS
from ds4pool.metrics import (
    CONTENT_TYPE,
    SNAPSHOT_ERROR_KINDS,
    Metrics,
    render,
    snapshot_error_kind,
)
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.sched.request import Event, Request

TENANT = "acme-tenant"
# every label a ds4pool metric may have; anything else (a session id, a tenant) is a bug
ALLOWED_LABELS = {
    "endpoint", "status", "priority", "tier", "from", "to", "reason", "kind", "choice",
    "model", "device", "dtype", "version", "le", "result", "op", "replica",
}  # fmt: skip

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def make_engine(loaded: LoadedModel, metrics: Metrics, **kw: object) -> Engine:
    kw.setdefault("kv_device_gb", 0.05)  # 12k tokens of demo KV: plenty, and fast
    engine = Engine(
        EngineConfig(**kw),  # type: ignore[arg-type]
        loaded=loaded,
        pool_observer=metrics.pool_observer(),
        sched_observer=metrics.scheduler_observer(),
    )
    metrics.bind(engine)
    return engine


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def engine(loaded: LoadedModel, metrics: Metrics, tmp_path: Path) -> Iterator[Engine]:
    e = make_engine(loaded, metrics, kv_disk_dir=tmp_path / "kv")
    try:
        yield e
    finally:
        e.close()


def value(m: Metrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def moves(m: Metrics, src: str, dst: str, reason: str) -> float:
    return value(m, "ds4pool_session_moves_total", **{"from": src, "to": dst, "reason": reason})


def scrape(m: Metrics) -> Samples:
    """Render and parse the exposition text, as Prometheus would."""
    text = render(m).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def chat(loaded: LoadedModel, i: int, words: int) -> str:
    body = " ".join(f"token{j} of agent {i}" for j in range(words))
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": body}])


def run(engine: Engine, reqs: list[Request], metrics: Metrics | None = None) -> list[Event]:
    """Run requests concurrently; with `metrics`, record each one as the HTTP layer does."""
    streams = [engine.submit(r) for r in reqs]  # all queued before the worker drains them
    finals = []
    for r, s in zip(reqs, streams):
        _, _, final = s.collect(timeout=60)
        assert final.error is None, final.error
        finals.append(final)
        if metrics is not None:
            assert final.finish_reason is not None
            metrics.request_finished(r.endpoint, final.finish_reason, time.monotonic() - r.arrival)
    return finals


def test_counters_and_histograms_follow_a_concurrent_workload(
    loaded: LoadedModel, metrics: Metrics, engine: Engine
) -> None:
    endpoints = ["chat", "chat", "completions", "messages", "chat", "engine"]
    n = len(endpoints)
    first = [
        Request(
            tenant=TENANT,
            session_id=f"agent-{i}",
            prompt_text=chat(loaded, i, 4 + 3 * i),
            max_tokens=5 + i,
            ignore_eos=True,  # every sampled token is a completion token: exact counts
            endpoint=ep,
        )
        for i, ep in enumerate(endpoints)
    ]
    finals = run(engine, first, metrics)
    # a second turn of agent-0 that extends its conversation: a prefix hit
    assert first[0].prompt_text is not None
    follow = Request(
        tenant=TENANT,
        session_id="agent-0",
        prompt_text=first[0].prompt_text + "(tool result) ok",
        max_tokens=3,
        ignore_eos=True,
        endpoint="chat",
    )
    finals += run(engine, [follow], metrics)
    usages = [f.usage for f in finals if f.usage is not None]
    assert len(usages) == n + 1 and all(f.finish_reason == "length" for f in finals)
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    assert cached > 0

    m = metrics
    for ep, count in {"chat": 4, "completions": 1, "messages": 1, "engine": 1}.items():
        assert value(m, "ds4pool_requests_total", endpoint=ep, status="length") == count, ep
        assert value(m, "ds4pool_requests_total", endpoint=ep, status="error") == 0, ep
        assert value(m, "ds4pool_request_duration_seconds_count", endpoint=ep) == count, ep
        # TTFT comes from the scheduler, labelled with Request.endpoint
        assert value(m, "ds4pool_time_to_first_token_seconds_count", endpoint=ep) == count, ep
    assert value(m, "ds4pool_prompt_tokens_total") == prompt
    assert value(m, "ds4pool_prefix_hit_tokens_total") == cached
    assert value(m, "ds4pool_generation_tokens_total") == completion
    assert value(m, "ds4pool_queue_wait_seconds_count") == n + 1
    # one first token per request, then one inter-token gap per further token
    assert value(m, "ds4pool_inter_token_latency_seconds_count") == completion - (n + 1)

    # steps: one observation each; the tokens they computed are the prompts' uncached
    # tokens and every sampled token except each request's last (never fed back)
    steps = value(m, "ds4pool_batch_size_count")
    assert steps == engine.worker.steps == value(m, "ds4pool_step_duration_seconds_count")
    assert value(m, "ds4pool_batch_tokens_sum") == (prompt - cached) + (completion - (n + 1))
    assert value(m, "ds4pool_step_duration_seconds_sum") > 0
    # host time around each forward: one observation per step
    assert value(m, "ds4pool_step_host_seconds_count") == steps
    assert 0 < value(m, "ds4pool_step_host_seconds_sum")
    # concurrent requests were batched: some step ran more than one sequence
    assert value(m, "ds4pool_batch_size_bucket", le="1.0") < steps
    assert value(m, "ds4pool_batch_size_sum") / steps > 1

    # scrape-time gauges after the work: nothing waits or runs, n sessions on the device
    s = scrape(m)
    assert s[("ds4pool_running_requests", ())] == 0
    assert s[("ds4pool_queue_depth", (("priority", "0"),))] == 0
    assert s[("ds4pool_sessions", (("tier", "device"),))] == n
    assert s[("ds4pool_kv_blocks_used", ())] > 0
    assert s[("ds4pool_kv_blocks_total", ())] == engine.pool.blocks.num_blocks

    # no label carries a session id or a tenant
    for (name, labels), _ in s.items():
        assert {k for k, _ in labels} <= ALLOWED_LABELS, name
        for _, v in labels:
            assert TENANT not in v and "agent-" not in v, (name, labels)


def test_tier_gauges_follow_evictions_and_restores(
    loaded: LoadedModel, metrics: Metrics, engine: Engine
) -> None:
    m = metrics
    # The demo session's KV is a few KB: its copy back from RAM can take less than the
    # 0.1 ms under which the pool ignores a sample as timer noise (it did on a fast CI
    # machine). Count every sample here, so that the rates below are measured on any host.
    engine.pool.cost.priors = CostPriors(min_seconds=1e-9)
    prompt = chat(loaded, 0, 20)
    run(engine, [Request(tenant=TENANT, session_id="s1", prompt_text=prompt, max_tokens=4)])

    def tiers() -> dict[str, tuple[float, float]]:
        s = scrape(m)
        return {
            t: (s[("ds4pool_sessions", (("tier", t),))], s[("ds4pool_kv_bytes", (("tier", t),))])
            for t in ("device", "ram", "disk")
        }

    t = tiers()
    assert t["device"][0] == 1 and t["device"][1] > 0 and t["ram"] == (0, 0)
    assert value(m, "ds4pool_kv_blocks_used") > 0
    budget = engine.pool.usage().disk_budget_bytes
    assert value(m, "ds4pool_kv_budget_bytes", tier="disk") == budget > 0
    assert value(m, "ds4pool_kv_budget_bytes", tier="device") > 0

    engine.pool.evict(TENANT, "s1", "ram")
    t = tiers()
    assert t["device"] == (0, 0) and t["ram"][0] == 1 and t["ram"][1] > 0
    assert value(m, "ds4pool_kv_blocks_used") == 0
    assert moves(m, "device", "ram", "admin") == 1

    # Let the write-behind snapshot (queued by the demotion to RAM) land first, so that the
    # eviction below finds it current and only drops the RAM copy.
    assert engine.pool.writer is not None and engine.pool.writer.drain()
    engine.pool.evict(TENANT, "s1", "disk")
    t = tiers()
    assert t["ram"] == (0, 0) and t["disk"][0] == 1 and t["disk"][1] > 0
    assert moves(m, "ram", "disk", "admin") == 1 and moves(m, "ram", "none", "admin") == 0

    # the next turn restores it: one disk → device move, timed from the read to the copy
    run(engine, [Request(tenant=TENANT, session_id="s1", prompt_text=prompt + "x", max_tokens=2)])
    t = tiers()
    assert t["device"][0] == 1 and t["disk"][0] == 0 and t["ram"][0] == 0
    assert moves(m, "disk", "device", "restore") == 1
    assert moves(m, "disk", "ram", "restore") == 0 and moves(m, "ram", "device", "restore") == 0
    assert value(m, "ds4pool_restore_duration_seconds_count", tier="disk") == 1
    assert value(m, "ds4pool_restore_duration_seconds_count", tier="ram") == 0
    assert value(m, "ds4pool_prefix_hit_tokens_total") > 0  # the restored KV was reused
    # read back, not recomputed (kv/cost.py: the demo model reads far faster than it
    # prefills), and the rates that decided it, measured on these very moves
    decisions = {
        (tier, choice): value(m, "ds4pool_restore_decisions_total", tier=tier, choice=choice)
        for tier in ("ram", "disk")
        for choice in ("read", "recompute")
    }
    assert decisions == {
        ("disk", "read"): 1, ("disk", "recompute"): 0, ("ram", "read"): 0, ("ram", "recompute"): 0
    }  # fmt: skip
    render(m)
    rates = engine.pool.cost.rates()
    assert {"disk", "ram", "prefill"} <= rates.measured
    disk_rate = value(m, "ds4pool_tier_read_bytes_per_second", tier="disk")
    assert disk_rate == rates.disk_bytes_per_s != CostPriors().disk_bytes_per_s
    assert value(m, "ds4pool_prefill_tokens_per_second") == rates.prefill_tokens_per_s > 0


def test_corrupt_snapshot_is_counted_as_checksum_error(
    loaded: LoadedModel, metrics: Metrics, tmp_path: Path
) -> None:
    disk = tmp_path / "kv"
    first = make_engine(loaded, Metrics(), kv_disk_dir=disk)
    try:
        prompt = chat(loaded, 1, 30)
        run(first, [Request(tenant=TENANT, session_id="s2", prompt_text=prompt, max_tokens=3)])
        first.pool.evict(TENANT, "s2", "disk")
    finally:
        first.close()
    [snap] = list(disk.glob("*.snap"))
    data = bytearray(snap.read_bytes())
    data[-20] ^= 0xFF  # inside the last section: the header still validates at startup
    snap.write_bytes(bytes(data))

    second = make_engine(loaded, metrics, kv_disk_dir=disk)
    try:
        assert value(metrics, "ds4pool_sessions", tier="disk") == 0  # not scraped yet
        render(metrics)
        assert value(metrics, "ds4pool_sessions", tier="disk") == 1  # indexed at startup
        [final] = run(
            second, [Request(tenant=TENANT, session_id="s2", prompt_text=prompt, max_tokens=2)]
        )
        assert final.usage is not None and final.usage.cached_tokens == 0  # recomputed
    finally:
        second.close()
    assert value(metrics, "ds4pool_snapshot_errors_total", kind="checksum") == 1
    others = [k for k in SNAPSHOT_ERROR_KINDS if k != "checksum"]
    assert all(value(metrics, "ds4pool_snapshot_errors_total", kind=k) == 0 for k in others)


def test_label_values_are_bounded(metrics: Metrics) -> None:
    pool, sched = metrics.pool_observer(), metrics.scheduler_observer()
    # every disk-tier error kind maps onto the documented set
    assert {snapshot_error_kind(k) for k in ERROR_KINDS} == set(SNAPSHOT_ERROR_KINDS)
    for kind in ERROR_KINDS:
        pool.snapshot_error(kind)
    counted = [
        value(metrics, "ds4pool_snapshot_errors_total", kind=k) for k in SNAPSHOT_ERROR_KINDS
    ]
    assert sum(counted) == len(ERROR_KINDS)
    assert value(metrics, "ds4pool_snapshot_errors_total", kind="quarantine") == 2

    sched.rejected("queue_full")
    sched.rejected("something new")
    sched.preempted()
    pool.session_moved("device", "gpu7", "why not")
    pool.restored("tape", 1.0)
    pool.restore_decided("tape", "maybe")
    assert value(metrics, "ds4pool_rejected_total", reason="queue_full") == 1
    assert value(metrics, "ds4pool_rejected_total", reason="other") == 1
    assert value(metrics, "ds4pool_preemptions_total") == 1
    assert moves(metrics, "device", "other", "other") == 1
    assert value(metrics, "ds4pool_restore_duration_seconds_count", tier="other") == 1
    assert value(metrics, "ds4pool_restore_decisions_total", tier="other", choice="other") == 1

    metrics.request_failed("/v1/chat/completions", 429)
    metrics.request_failed("/v1/completions", 503)
    metrics.request_failed("/v1/messages", 400)
    metrics.request_failed("/v1/messages/", 500)
    metrics.request_failed("/admin/sessions", 401)  # not a generation route: not counted
    metrics.request_finished("/v1/whatever?session=agent-9", "teapot", 1.0)
    metrics.request_finished("chat", "invalid", 0.01)  # counted, not timed

    def requests(endpoint: str, status: str) -> float:
        return value(metrics, "ds4pool_requests_total", endpoint=endpoint, status=status)

    assert requests("chat", "rejected") == requests("completions", "rejected") == 1
    assert requests("messages", "invalid") == requests("messages", "error") == 1
    assert requests("chat", "invalid") == 1 and requests("other", "other") == 1
    total = sum(
        s.value
        for fam in metrics.registry.collect()
        for s in fam.samples
        if s.name == "ds4pool_requests_total"
    )
    assert total == 6
    # only requests the engine accepted (a known finish reason) are timed
    for ep in ("chat", "other"):
        assert value(metrics, "ds4pool_request_duration_seconds_count", endpoint=ep) == 0


def test_render_and_build_info(loaded: LoadedModel, metrics: Metrics, engine: Engine) -> None:
    body, content_type = metrics.render()
    assert content_type == CONTENT_TYPE and content_type.startswith("text/plain")
    assert b"ds4pool_build_info{" in body
    s = scrape(metrics)
    [(labels, v)] = [(dict(k[1]), v) for k, v in s.items() if k[0] == "ds4pool_build_info"]
    assert v == 1
    assert labels["model"] == loaded.name and labels["device"] == "cpu"
    assert labels["dtype"] == "float32" and labels["version"]
    assert s[("ds4pool_cpu_threads", ())] == torch.get_num_threads()  # the model's threads
    # the priority label is clamped, and the depths add up at the bound
    queue = engine.scheduler.queue
    queue.depth_by_priority = lambda: {0: 2, 50: 3, 99: 1}  # type: ignore[method-assign]
    s = scrape(metrics)
    assert s[("ds4pool_queue_depth", (("priority", "10"),))] == 4
    assert s[("ds4pool_queue_depth", (("priority", "0"),))] == 2
    del queue.depth_by_priority
    s = scrape(metrics)
    assert ("ds4pool_queue_depth", (("priority", "10"),)) not in s  # gone once drained


def test_render_binds_an_engine_on_first_sight(engine: Engine) -> None:
    fresh = Metrics()  # created without bind(), as an app may do
    assert b'model=""' in render(fresh)
    body, _ = fresh.render(engine)
    assert b"ds4pool_kv_blocks_total " in body and b'model=""' not in body
    assert fresh.engine is engine and value(fresh, "ds4pool_kv_blocks_total") > 0


def test_metrics_instances_do_not_share_a_registry() -> None:
    a, b = Metrics(), Metrics()
    a.scheduler_observer().preempted()
    assert value(a, "ds4pool_preemptions_total") == 1
    assert value(b, "ds4pool_preemptions_total") == 0


def test_block_index_hits_cached_blocks_and_evictions(loaded: LoadedModel) -> None:
    m = Metrics()
    per_block = loaded.config.kv_bytes_per_token(4) * 16
    e = make_engine(loaded, m, kv_device_gb=48 * per_block / (1 << 30))  # 48 blocks
    try:
        system = " ".join(f"rule{j}" for j in range(60))
        a, b = chat(loaded, 1, 4), chat(loaded, 2, 4)
        run(e, [Request(tenant=TENANT, session_id="a", prompt_text=system + a, max_tokens=2)])
        assert value(m, "ds4pool_block_index_hit_tokens_total") == 0
        run(e, [Request(tenant=TENANT, session_id="b", prompt_text=system + b, max_tokens=2)])
        hits = value(m, "ds4pool_block_index_hit_tokens_total")
        assert hits >= 160  # b took a's system prompt blocks
        s = scrape(m)
        assert s[("ds4pool_kv_blocks_indexed", ())] > 0 and s[("ds4pool_kv_blocks_cached", ())] == 0
        e.pool.evict(TENANT, "a", "ram")
        e.pool.evict(TENANT, "b", "ram")
        assert scrape(m)[("ds4pool_kv_blocks_cached", ())] > 0  # still on the device, unheld
        assert value(m, "ds4pool_block_index_evictions_total") == 0
        big = chat(loaded, 3, 48)  # ~30 blocks: more than the free ones, cached ones go
        run(e, [Request(tenant=TENANT, session_id="c", prompt_text=big, max_tokens=2)])
        assert value(m, "ds4pool_block_index_evictions_total") > 0
        e.pool.check_integrity()
    finally:
        e.close()
