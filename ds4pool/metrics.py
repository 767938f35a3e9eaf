"""Every Prometheus metric ds4pool exports, defined in one place.

The app owns one `Metrics` per engine (created at startup, kept in `app.state`); there is
no module-level registry or metric, so tests and several apps in one process never share
series. Wiring:

    metrics = Metrics()
    engine = Engine(cfg, pool_observer=metrics.pool_observer(),
                    sched_observer=metrics.scheduler_observer())
    metrics.bind(engine)                        # build info; gauges refreshed at scrape time
    body, content_type = metrics.render()       # GET /metrics (off the event loop)
    metrics.request_finished("chat", final.finish_reason, seconds)   # per HTTP request

Who records what:
- the scheduler observer: steps (batch size, tokens, duration), queue wait, TTFT (by the
  Request's `endpoint`) and inter-token latency, token counters, preemptions, admission
  rejections;
- the pool observer: tier moves, restore latency, snapshot errors, block index hits and
  evictions;
- `collect_gauges()` at scrape time: queue depth, running requests, sessions, KV bytes,
  budgets and device blocks (read from the engine, so they can never drift);
- the HTTP layer, which alone sees every request (validation and auth failures, 429s, the
  time spent streaming): `request_finished()` / `request_failed()` → requests_total and
  request_duration.

Conventions: base units (seconds, bytes), counters end in `_total`, and every label has a
bounded set of values. Values outside a label's set are recorded as "other" rather than
raising (an observer must never break a step) or creating a new series. No label ever
carries a session id, a tenant or a user-supplied string.

Histogram buckets (upper bounds, seconds unless noted):

- LATENCY_BUCKETS — TTFT, request duration, queue wait: 5 ms … 10 min. A prefix hit on a
  warm session answers in tens of ms; a cold 30k-token prefill takes seconds on a GPU and
  minutes on a CPU; a long generation runs for minutes.
- TOKEN_LATENCY_BUCKETS — inter-token latency and step duration: 1 ms … 10 s, dense
  between 10 and 200 ms where decode steps of a batched GPU server live.
- HOST_BUCKETS — host time of a step outside its forward (planning + writeback): 0.1 ms …
  1 s; a few hundred µs is normal, milliseconds next to a ~5 ms GPU step is what an
  overlapped loop would win back.
- RESTORE_BUCKETS — KV restore per tier: 1 ms … 30 s (a RAM→device copy is milliseconds;
  a large lz4 snapshot read from disk can take seconds).
- BATCH_SIZE_BUCKETS (sequences per step): 1 … 512, roughly ×1.5 steps around the default
  --max-batch-size of 64.
- BATCH_TOKENS_BUCKETS (tokens per step): powers of two, 1 … 16384 (default
  --max-batch-tokens is 2048).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

from ds4pool import __version__
from ds4pool.kv.pool import PoolObserver
from ds4pool.sched.scheduler import SchedulerObserver
from ds4pool.sched.seq import Seq

if TYPE_CHECKING:  # the engine pulls in torch and the model; metrics only reads it
    from ds4pool.engine import Engine

# Every name and label here is a legacy Prometheus name, so generate_latest's output is the
# classic 0.0.4 text format; announce that (not 1.0.0) so every Prometheus version parses it.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
HOST_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
    0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
RESTORE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
BATCH_TOKENS_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1 … 16384
# prompt work budgets (token-equivalents): the floor (16) … the CUDA cap (640; 896 before
# session 21) and above
WORK_BUDGET_BUCKETS = (16.0, 32.0, 64.0, 112.0, 128.0, 256.0, 512.0, 640.0, 896.0, 1024.0, 2048.0)

# ---------------------------------------------------------------- label value sets

OTHER = "other"  # any value outside a label's set

# The `endpoint` label (Request.endpoint): the API's generation routes, and "engine" for
# requests submitted to the engine directly (CLI, benchmarks, tests).
ENDPOINT_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/messages": "messages",
    "/v1/responses": "responses",
}
ENDPOINTS = (*ENDPOINT_PATHS.values(), "engine")
# The `status` label of ds4pool_requests_total: the engine's finish reasons, plus the
# requests that ended with an HTTP error before the engine accepted them.
ENGINE_STATUSES = ("stop", "length", "cancelled", "error")
API_STATUSES = ("rejected", "invalid")  # 429/503 admission or draining; other 4xx
REQUEST_STATUSES = ENGINE_STATUSES + API_STATUSES
TIERS = ("device", "ram", "disk")
MOVE_TIERS = (*TIERS, "none")  # "none": the KV is gone (dropped, lost, evicted off disk)
# "serialized": --no-batching's evictions, once the scheduler names them (today: "admin")
MOVE_REASONS = ("pressure", "preempt", "admin", "ram_full", "disk_full", "restore", "serialized")
# Tier moves the session pool can make, pre-created at 0 so rate() sees the first one.
KNOWN_MOVES = (
    *(("device", "ram", r) for r in ("pressure", "preempt", "admin")),
    *(("ram", "disk", r) for r in ("pressure", "preempt", "admin", "ram_full")),
    *(("ram", "none", r) for r in ("pressure", "preempt", "admin", "ram_full")),
    ("disk", "ram", "restore"),
    ("ram", "device", "restore"),
    ("disk", "none", "disk_full"),
)
RESTORE_TIERS = ("ram", "disk")  # the tier a restore reads from
RESTORE_CHOICES = ("read", "recompute")  # kv/cost.py's decision for a returning session
REJECT_REASONS = ("queue_full", "tenant_queue_full", "draining")
# shared snapshot store (--replica-id): how lease claims ended, snapshot I/O directions
LEASE_CLAIMS = ("renewed", "acquired", "taken_over", "foreign")
STORE_OPS = ("read", "write")
STORE_ERROR_KINDS = ("lease",)

# ds4pool_snapshot_errors_total{kind}: the disk tier's ERROR_KINDS folded into a small set
# that says what an operator has to do:
#   checksum    — a snapshot's CRC failed (bit rot, a torn write): quarantined
#   fingerprint — written by another model or dtype: quarantined (expected after a swap)
#   quarantine  — any other invalid file (truncated, bad format): quarantined
#   write       — a snapshot could not be written (ENOSPC, EIO) or alone exceeds the budget;
#                 the session's KV stays in memory or is recomputed later
#   read        — an I/O error while reading a snapshot (the file is kept)
SNAPSHOT_ERROR_KINDS = ("checksum", "fingerprint", "quarantine", "write", "read")
_SNAPSHOT_KIND_MAP = {
    "checksum": "checksum",
    "fingerprint": "fingerprint",
    "truncated": "quarantine",
    "format": "quarantine",
    "write": "write",
    "too_large": "write",
    "io": "read",
}
# queue depth by priority: priorities come from clients, so the label is clamped to
# [-PRIORITY_LABEL_BOUND, PRIORITY_LABEL_BOUND] (beyond it, counted at the bound)
PRIORITY_LABEL_BOUND = 10


def _pick(value: object, allowed: Iterable[str]) -> str:
    return value if isinstance(value, str) and value in allowed else OTHER


def status_for_http(http_status: int) -> str:
    """The `status` label of a request that failed with this HTTP status before the engine
    accepted it: 429/503 → rejected (admission, loading, draining), other 4xx → invalid,
    5xx → error."""
    if http_status in (429, 503):
        return "rejected"
    return "invalid" if 400 <= http_status < 500 else "error"


def snapshot_error_kind(kind: str) -> str:
    """The `kind` label for one of the disk tier's error kinds (kv/disk_hooks.py's ERROR_KINDS)."""
    return _SNAPSHOT_KIND_MAP.get(kind, OTHER)


def priority_label(priority: int) -> str:
    return str(max(-PRIORITY_LABEL_BOUND, min(PRIORITY_LABEL_BOUND, int(priority))))


class Metrics:
    """The registry and every metric object. Thread-safe (prometheus_client's metrics are);
    the observers update it from the worker and persistence threads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine: Engine | None = None
        self._render_lock = threading.Lock()
        r = self.registry

        # -- steps and batching (scheduler observer)
        self.batch_size = Histogram(
            "ds4pool_batch_size",
            "Sequences (requests) in one forward step.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=r,
        )
        self.batch_tokens = Histogram(
            "ds4pool_batch_tokens",
            "Tokens computed in one forward step (prompt chunks plus decode tokens).",
            buckets=BATCH_TOKENS_BUCKETS,
            registry=r,
        )
        self.step_duration = Histogram(
            "ds4pool_step_duration_seconds",
            "Wall time of one forward step (model, sampling, the host sync).",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )

        self.prefill_budget = Histogram(
            "ds4pool_prefill_work_budget",
            "Prompt work one step next to decoders was allowed, in token-equivalents "
            "(--max-prefill-cost, lowered by --prefill-decode-ratio and --itl-budget-factor).",
            buckets=WORK_BUDGET_BUCKETS,
            registry=r,
        )
        self.prefill_burst = Counter(
            "ds4pool_prefill_burst_prompts_total",
            "Prompts whose last chunk started in a step's burst room next to decoders "
            "(--prefill-burst): past the single token and work caps, each within them alone.",
            registry=r,
        )
        self.prefill_work_seconds = Gauge(
            "ds4pool_prefill_seconds_per_work",
            "Measured seconds per token-equivalent of prompt work in steps next to decoders "
            "(EWMA, the decode step's share taken out; until the first, in prompt-only steps), "
            "that --itl-budget-factor sizes chunks with. 0 until measured.",
            registry=r,
        )
        self.step_host = Histogram(
            "ds4pool_step_host_seconds",
            "Host time of one step outside the forward: planning the batch and writing back "
            "its tokens (the device waits meanwhile).",
            buckets=HOST_BUCKETS,
            registry=r,
        )

        # -- request latencies
        self.ttft = Histogram(
            "ds4pool_time_to_first_token_seconds",
            "Time from a request's arrival to its first sampled token (queue wait included).",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "ds4pool_inter_token_latency_seconds",
            "Time between two consecutive sampled tokens of one request.",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_duration = Histogram(
            "ds4pool_request_duration_seconds",
            "End-to-end time of requests the engine accepted, as the HTTP layer measures it.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "ds4pool_queue_wait_seconds",
            "Time a request waited in the queue before it was admitted to a batch.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

        # -- scrape-time gauges (collect_gauges)
        self.queue_depth = Gauge(
            "ds4pool_queue_depth",
            "Requests waiting to be admitted, by priority (lower runs first).",
            ["priority"],
            registry=r,
        )
        self.running_requests = Gauge(
            "ds4pool_running_requests",
            "Requests admitted and being computed (in the running batch).",
            registry=r,
        )
        self.sessions = Gauge(
            "ds4pool_sessions", "Sessions whose KV lives in each tier.", ["tier"], registry=r
        )
        self.kv_bytes = Gauge(
            "ds4pool_kv_bytes",
            "Bytes of KV held in each tier (device: KV of device sessions; disk: file sizes).",
            ["tier"],
            registry=r,
        )
        self.kv_budget_bytes = Gauge(
            "ds4pool_kv_budget_bytes",
            "Byte budget of each tier (0: the tier is not configured).",
            ["tier"],
            registry=r,
        )
        self.kv_blocks_used = Gauge(
            "ds4pool_kv_blocks_used", "Device KV blocks in use.", registry=r
        )
        self.kv_blocks_total = Gauge(
            "ds4pool_kv_blocks_total", "Device KV blocks preallocated.", registry=r
        )
        self.cpu_threads = Gauge(
            "ds4pool_cpu_threads",
            "The model's CPU threads now (the start-up probe's count, one fewer while other "
            "processes keep a core busy); 0 off CPU.",
            registry=r,
        )
        self.kv_blocks_indexed = Gauge(
            "ds4pool_kv_blocks_indexed",
            "Full device KV blocks in the block index (shareable by content, per tenant).",
            registry=r,
        )
        self.kv_blocks_cached = Gauge(
            "ds4pool_kv_blocks_cached",
            "Indexed device KV blocks no session holds (kept for reuse, evicted when needed).",
            registry=r,
        )
        self.kv_blocks_pinned = Gauge(
            "ds4pool_kv_blocks_pinned",
            "Indexed device KV blocks of pinned prefixes (never evicted).",
            registry=r,
        )

        # -- sessions (pool observer)
        self.session_moves = Counter(
            "ds4pool_session_moves_total",
            "Session KV moves between tiers ('none': the KV was lost or dropped).",
            ["from", "to", "reason"],
            registry=r,
        )
        self.restore_duration = Histogram(
            "ds4pool_restore_duration_seconds",
            "Time to restore a session's KV from a tier (disk: read into RAM; ram: copy to "
            "the device). A restore from disk observes both.",
            ["tier"],
            buckets=RESTORE_BUCKETS,
            registry=r,
        )
        self.restore_decisions = Counter(
            "ds4pool_restore_decisions_total",
            "Returning sessions whose KV in a tier (ram, disk) was read back or recomputed "
            "(choice), from the measured rates below (or --restore-policy).",
            ["tier", "choice"],
            registry=r,
        )
        self.tier_read_rate = Gauge(
            "ds4pool_tier_read_bytes_per_second",
            "Measured rate (EWMA) of reading KV back from a tier: ram = the host to device "
            "copy; disk = the snapshot read, checksum and decode. A prior until measured.",
            ["tier"],
            registry=r,
        )
        self.prefill_rate = Gauge(
            "ds4pool_prefill_tokens_per_second",
            "Measured prefill rate (EWMA over steps with prompt tokens, the decode rows' "
            "share taken out) that a recompute is priced at. A prior until measured.",
            registry=r,
        )
        self.index_hit_tokens = Counter(
            "ds4pool_block_index_hit_tokens_total",
            "Tokens of KV taken from the block index by a prompt or a restore (another "
            "session's blocks, or this session's other branch) instead of computed or copied.",
            registry=r,
        )
        self.index_evictions = Counter(
            "ds4pool_block_index_evictions_total",
            "Cached blocks evicted from the block index to make room on the device.",
            registry=r,
        )
        self.snapshot_errors = Counter(
            "ds4pool_snapshot_errors_total",
            "Disk tier snapshot failures: checksum, fingerprint, quarantine, write, read.",
            ["kind"],
            registry=r,
        )

        # -- shared snapshot store (replicas)
        self.store_foreign_restores = Counter(
            "ds4pool_store_foreign_restores_total",
            "Sessions restored from a snapshot that another replica wrote (shared store).",
            registry=r,
        )
        self.lease_claims = Counter(
            "ds4pool_store_lease_claims_total",
            "Session lease claims in the shared store by result: renewed, acquired, "
            "taken_over (another replica's lease had expired), foreign (served, not persisted).",
            ["result"],
            registry=r,
        )
        self.store_bytes = Counter(
            "ds4pool_store_bytes_total",
            "Snapshot bytes read from and written to the disk tier (the shared store).",
            ["op"],
            registry=r,
        )
        self.store_errors = Counter(
            "ds4pool_store_errors_total",
            "Lease files that could not be read or written (snapshot failures are "
            "ds4pool_snapshot_errors_total).",
            ["kind"],
            registry=r,
        )

        # -- tokens and requests
        self.prompt_tokens = Counter(
            "ds4pool_prompt_tokens_total",
            "Prompt tokens of finished requests (prefix hits included).",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "ds4pool_prefix_hit_tokens_total",
            "Prompt tokens whose KV was reused (the session's own or shared blocks) instead of "
            "computed.",
            registry=r,
        )
        self.generation_tokens = Counter(
            "ds4pool_generation_tokens_total",
            "Tokens generated by finished requests.",
            registry=r,
        )
        self.requests = Counter(
            "ds4pool_requests_total",
            "Requests by endpoint and outcome (stop, length, cancelled, error; rejected and "
            "invalid: refused before the engine accepted them).",
            ["endpoint", "status"],
            registry=r,
        )
        self.preemptions = Counter(
            "ds4pool_preemptions_total",
            "Running requests preempted (KV moved to RAM, requeued) for lack of device blocks.",
            registry=r,
        )
        self.rejected = Counter(
            "ds4pool_rejected_total",
            "Requests refused by admission control, by reason.",
            ["reason"],
            registry=r,
        )
        self.build_info = Info(
            "ds4pool_build", "The model and runtime this server runs.", registry=r
        )
        self.build_info.info(
            {"model": "", "device": "", "dtype": "", "version": __version__, "replica": ""}
        )

        self._precreate()

    def _precreate(self) -> None:
        """Create every known label combination at 0, so that series exist from the first
        scrape: rate()/increase() then see the first event, and dashboards show 0."""
        for endpoint in ENDPOINTS:
            self.ttft.labels(endpoint)
            self.request_duration.labels(endpoint)
            for status in REQUEST_STATUSES:
                self.requests.labels(endpoint, status)
        for src, dst, reason in KNOWN_MOVES:
            self.session_moves.labels(src, dst, reason)
        for tier in RESTORE_TIERS:
            self.restore_duration.labels(tier)
            self.tier_read_rate.labels(tier)
            for choice in RESTORE_CHOICES:
                self.restore_decisions.labels(tier, choice)
        for kind in SNAPSHOT_ERROR_KINDS:
            self.snapshot_errors.labels(kind)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for claim in LEASE_CLAIMS:
            self.lease_claims.labels(claim)
        for op in STORE_OPS:
            self.store_bytes.labels(op)
        for kind in STORE_ERROR_KINDS:
            self.store_errors.labels(kind)
        for tier in TIERS:
            self.sessions.labels(tier)
            self.kv_bytes.labels(tier)
            self.kv_budget_bytes.labels(tier)
        self.queue_depth.labels(priority_label(0))

    # ------------------------------------------------------------ for the HTTP layer

    def pool_observer(self) -> MetricsPoolObserver:
        return MetricsPoolObserver(self)

    def scheduler_observer(self) -> MetricsSchedulerObserver:
        return MetricsSchedulerObserver(self)

    def bind(self, engine: Engine) -> None:
        """Attach the engine: sets build info and lets render() refresh the gauges."""
        loaded = engine.loaded
        self.build_info.info(
            {
                "model": loaded.name,
                "device": str(loaded.device),
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "version": __version__,
                "replica": engine.cfg.replica_id or "",
            }
        )
        self.engine = engine

    def request_finished(self, endpoint: str, status: str, seconds: float | None = None) -> None:
        """One HTTP request is over: count it, and time it if the engine accepted it.

        Call exactly once per generation request. For a request the engine accepted,
        `status` is its finish reason (stop, length, cancelled, error) and `seconds` its
        end-to-end time; for one refused earlier, use request_failed() (or pass "rejected"
        / "invalid" here without seconds). Unknown values are recorded as "other"."""
        ep, st = _pick(endpoint, ENDPOINTS), _pick(status, REQUEST_STATUSES)
        self.requests.labels(ep, st).inc()
        if seconds is not None and st in ENGINE_STATUSES:
            self.request_duration.labels(ep).observe(seconds)

    def request_failed(self, path: str, http_status: int) -> None:
        """Count a generation request that ended with an HTTP error before engine.submit()
        returned (validation, auth, 429 admission or tenant limit, 503 loading/draining).
        Paths other than the generation routes are ignored. Not for errors reported by the
        engine's first event: request_finished() already counted those."""
        endpoint = ENDPOINT_PATHS.get(path.rstrip("/"))
        if endpoint is not None:
            self.requests.labels(endpoint, status_for_http(http_status)).inc()

    def render(self, engine: Engine | None = None) -> tuple[bytes, str]:
        """(exposition text, content type) for GET /metrics; see render()."""
        return render(self, engine), CONTENT_TYPE


def request_endpoint(seq: Seq) -> str:
    return _pick(seq.req.endpoint, ENDPOINTS)


class MetricsSchedulerObserver(SchedulerObserver):
    """Scheduler hooks → metrics. Called on the worker thread; never raises."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def step(
        self, batch_size: int, num_tokens: int, seconds: float, host_seconds: float = 0.0
    ) -> None:
        self.m.batch_size.observe(batch_size)
        self.m.batch_tokens.observe(num_tokens)
        self.m.step_duration.observe(seconds)
        self.m.step_host.observe(host_seconds)

    def prefill_budget(self, work: float) -> None:
        self.m.prefill_budget.observe(work)

    def prefill_burst(self, chunks: int) -> None:
        self.m.prefill_burst.inc(chunks)

    def admitted(self, queue_wait_s: float) -> None:
        self.m.queue_wait.observe(queue_wait_s)

    def token(self, seq: Seq, first: bool, seconds: float) -> None:
        if first:
            self.m.ttft.labels(request_endpoint(seq)).observe(seconds)
        else:
            self.m.itl.observe(seconds)

    def finished(self, seq: Seq, reason: str) -> None:
        # Requests and their duration are the HTTP layer's (request_finished): it alone
        # sees the ones that never reach the engine. Tokens are counted once, at the end,
        # so the counters agree exactly with the usage the client is told (the eos token is
        # not a completion token; a preempted request resumes without counting twice).
        usage = seq.usage()
        self.m.prompt_tokens.inc(usage.prompt_tokens)
        self.m.prefix_hit_tokens.inc(usage.cached_tokens)
        self.m.generation_tokens.inc(usage.completion_tokens)

    def preempted(self) -> None:
        self.m.preemptions.inc()

    def rejected(self, reason: str) -> None:
        self.m.rejected.labels(_pick(reason, REJECT_REASONS)).inc()


class MetricsPoolObserver(PoolObserver):
    """Session pool hooks → metrics. Called under the pool lock or on the persistence
    thread; never raises."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def session_moved(self, src: str, dst: str, reason: str) -> None:
        self.m.session_moves.labels(
            _pick(src, MOVE_TIERS), _pick(dst, MOVE_TIERS), _pick(reason, MOVE_REASONS)
        ).inc()

    def restored(self, tier: str, seconds: float) -> None:
        self.m.restore_duration.labels(_pick(tier, RESTORE_TIERS)).observe(seconds)

    def snapshot_error(self, kind: str) -> None:
        self.m.snapshot_errors.labels(snapshot_error_kind(kind)).inc()

    def prefix_shared(self, num_tokens: int) -> None:
        self.m.index_hit_tokens.inc(num_tokens)

    def blocks_evicted(self, num_blocks: int) -> None:
        self.m.index_evictions.inc(num_blocks)

    def restore_decided(self, tier: str, choice: str) -> None:
        self.m.restore_decisions.labels(
            _pick(tier, RESTORE_TIERS), _pick(choice, RESTORE_CHOICES)
        ).inc()

    def lease_claimed(self, claim: str) -> None:
        self.m.lease_claims.labels(_pick(claim, LEASE_CLAIMS)).inc()

    def store_error(self, kind: str) -> None:
        self.m.store_errors.labels(_pick(kind, STORE_ERROR_KINDS)).inc()

    def store_io(self, op: str, num_bytes: int) -> None:
        self.m.store_bytes.labels(_pick(op, STORE_OPS)).inc(num_bytes)

    def foreign_restored(self) -> None:
        self.m.store_foreign_restores.inc()


def collect_gauges(metrics: Metrics, engine: Engine) -> None:
    """Refresh the gauges from the engine's current state (called at scrape time)."""
    sched = engine.scheduler
    with sched.lock:  # the waiting queue is guarded by the scheduler lock
        depth = sched.queue.depth_by_priority()
    # The running list belongs to the worker thread; len() of a list is atomic.
    metrics.running_requests.set(len(sched.running))
    by_label: dict[str, int] = {priority_label(0): 0}
    for priority, n in depth.items():
        label = priority_label(priority)
        by_label[label] = by_label.get(label, 0) + n
    # Priorities that no longer wait disappear, so clear before setting; the render lock
    # keeps a concurrent scrape from seeing the gap.
    metrics.queue_depth.clear()
    for label, n in by_label.items():
        metrics.queue_depth.labels(label).set(n)

    pool = engine.pool
    u = pool.usage()
    device_budget = u.device_blocks_total * pool.cfg.block_size * pool.kv_bytes_per_token
    for tier, sessions, used, budget in (
        ("device", u.device_sessions, u.device_bytes, device_budget),
        ("ram", u.ram_sessions, u.ram_bytes, u.ram_budget_bytes),
        ("disk", u.disk_sessions, u.disk_bytes, u.disk_budget_bytes),
    ):
        metrics.sessions.labels(tier).set(sessions)
        metrics.kv_bytes.labels(tier).set(used)
        metrics.kv_budget_bytes.labels(tier).set(budget)
    metrics.kv_blocks_used.set(u.device_blocks_used)
    metrics.kv_blocks_total.set(u.device_blocks_total)
    metrics.kv_blocks_indexed.set(u.device_blocks_indexed)
    metrics.kv_blocks_cached.set(u.device_blocks_cached)
    metrics.kv_blocks_pinned.set(u.device_blocks_pinned)
    rates = pool.cost.rates()
    metrics.tier_read_rate.labels("ram").set(rates.ram_bytes_per_s)
    metrics.tier_read_rate.labels("disk").set(rates.disk_bytes_per_s)
    metrics.prefill_rate.set(rates.prefill_tokens_per_s)
    # a float written by the worker thread: reading it needs no lock
    metrics.prefill_work_seconds.set(sched.step_time.seconds_per_work or 0.0)
    metrics.cpu_threads.set(engine.cpu_threads or 0)


def render(metrics: Metrics, engine: Engine | None = None) -> bytes:
    """The exposition text for GET /metrics (serve it with CONTENT_TYPE). Refreshes the
    gauges from `engine` (bound on first sight), or from the bound engine. Takes the pool
    lock briefly, which a demotion to disk may hold for a snapshot write: call it off the
    event loop."""
    with metrics._render_lock:
        if engine is not None and engine is not metrics.engine:
            metrics.bind(engine)
        engine = metrics.engine
        if engine is not None:
            collect_gauges(metrics, engine)
        return generate_latest(metrics.registry)
