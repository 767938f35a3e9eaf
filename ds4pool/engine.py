"""Engine: the model runner, the session pool, the scheduler and the decode worker, wired.

Importable without the server stack (no litestar/uvicorn), so GPU tests need only torch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ds4pool.cpu_share import ThreadGovernor
from ds4pool.kv.cost import RestorePolicy
from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.pool import DeviceKV, PoolConfig, PoolObserver, SessionPool
from ds4pool.kv.sharing import PrefixInfo
from ds4pool.kv.store_lease import validate_replica_id
from ds4pool.model.cpu_linear import CPU_LINEAR_MODES, pack_cpu_linears
from ds4pool.model.cuda_graphs import MODES as GRAPH_MODES
from ds4pool.model.device import BLAS_LIBRARIES, select_blas, select_device, select_dtype
from ds4pool.model.grammar import Constraint, GrammarCache, GrammarSpec
from ds4pool.model.loader import LoadedModel, load_model
from ds4pool.model.runner import ModelRunner
from ds4pool.model.warm_up import WarmUpReport
from ds4pool.sched.prefill_cost import DEFAULTS as PREFILL_COST
from ds4pool.sched.prefill_cost import RATIO_DEFAULTS, PrefillCost
from ds4pool.sched.queue import QueueConfig
from ds4pool.sched.request import Request, RequestStream
from ds4pool.sched.scheduler import Scheduler, SchedulerConfig, SchedulerObserver
from ds4pool.sched.step_time import FACTOR_DEFAULTS, check_factor
from ds4pool.sched.trace import StepTrace
from ds4pool.sched.worker import Worker
from ds4pool.threads import ThreadProbe, choose_threads

GB = 1 << 30


def fingerprint_for(loaded: LoadedModel) -> ModelFingerprint:
    """What a snapshot's KV depends on: architecture, KV layout and shape, dtype and the
    weights."""
    cfg = loaded.config
    kv_layout, _, heads, dim = cfg.kv_cache
    return ModelFingerprint(
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        num_kv_heads=heads,
        head_dim=dim,
        dtype=str(loaded.dtype).removeprefix("torch."),
        weights_id=loaded.weights_id,
        kv_layout=kv_layout,
    )


RESTORE_POLICIES = tuple(p.value for p in RestorePolicy)


@dataclass(frozen=True)
class EngineConfig:
    model: str = "demo"
    tokenizer: Path | None = None  # random:* and scripted:* only: a tokenizer directory
    device: str = "auto"
    dtype: str = "auto"
    kv_device_gb: float | None = None  # None: 2 GB on CPU/MPS, 85% of free memory on CUDA
    kv_block_size: int = 16
    kv_ram_gb: float = 4.0
    kv_disk_dir: Path | None = None  # None: no disk tier (sessions do not survive restarts)
    kv_disk_gb: float = 32.0
    kv_persist_idle_s: float = 30.0
    kv_persist_every_tokens: int = 4096
    restore_policy: str = "auto"  # auto | always | never: read KV back or recompute (kv/cost.py)
    max_batch_tokens: int = 2048
    # Prompt tokens per step while some sequence decodes; None: PREFILL_TOKENS by device.
    max_prefill_tokens: int | None = None
    # ... and prompt work per step then, in token-equivalents (sched/prefill_cost.py):
    # None: by device; 0: no work cap. prefill_cost_scale: K of that model, None: by device.
    max_prefill_cost: int | None = None
    prefill_cost_scale: int | None = None
    # ... and at most this x the decoders' own work (compute-bound devices: a mixed step
    # costs ~(1 + ratio) x a decode step); None: by device (off everywhere, measured); 0: off.
    prefill_decode_ratio: float | None = None
    # ... and at most what keeps a mixed step within this x the decode step it joins, from
    # measured step times (sched/step_time.py); None: by device (FACTOR_DEFAULTS); 0: off.
    itl_budget_factor: float | None = None
    # ... and up to this x the token and work caps as prompts' last chunks that fit the
    # single caps alone (a burst of short prompts, one step); None: by device; 1: off.
    prefill_burst: int | None = None
    max_batch_size: int = 64
    coalesce_us: int = 0
    # write a step's results back while the device runs the next one (sched/worker.py):
    # "on"; "ahead": also launch a steady decode batch's next step before this one is read
    # back (sched/ahead.py); "auto": ahead on CUDA, off elsewhere (on CPU the forward is host
    # work, nothing overlaps)
    overlap: str = "auto"
    no_batching: bool = False
    max_waiting: int = 1024
    max_waiting_per_tenant: int = 256
    aging_s: float = 10.0
    session_wait_s: float = 120.0
    tenant_weights: dict[str, float] = field(default_factory=dict)
    cache_dir: Path | None = None
    show_progress: bool = False
    # auto (triton on CUDA) | torch | triton | triton-split | triton-small (model/runner.py)
    attention_backend: str = "auto"
    blas: str = "auto"  # CUDA: torch's preferred BLAS library (model/device.py)
    # CPU: the projections through oneDNN prepacked weights (model/cpu_linear.py): auto is
    # onednn where it works (CPU, float32), torch is F.linear. oneDNN keeps a primitive per
    # distinct row count; PackedLinear's row buckets bound them to 28 per weight shape
    cpu_linear: str = "auto"
    # CPU: torch's intra-op threads for this process (None: torch's own, one per core);
    # `ds4pool serve` leaves one core to its HTTP side (threads.server_cpu_threads)
    cpu_threads: int | None = None
    # CPU, more than cpu_threads: at start-up, time a scratch step with each and keep the
    # faster (threads.choose_threads; `ds4pool serve --cpu-threads auto`: one per core)
    cpu_threads_up_to: int | None = None
    # CUDA graphs of decode and mixed steps (CUDA only): "ahead" (captured at start-up, for
    # at most graph_capture_s; the rest when idle), "lazy" (on first use), "eager" (none)
    cuda_graphs: str = "ahead"
    graph_capture_s: float = 120.0
    # CUDA: run the eager steps' kernel variants once at start-up, for at most
    # graph_capture_s (model/warm_up.py), so that no step compiles one while serving
    eager_warm_up: bool = True
    # CUDA: a mixed step of decodes and up to this many prompt chunks (their tokens together
    # within the graphs' largest chunk bucket) replays a graph; 1: one chunk, several run
    # eagerly (model/mixed_batch.py)
    graph_chunks: int = 1
    # Shared snapshot store: this replica's id; kv_disk_dir is the directory the replicas
    # share (kv/store.py). None: a private disk tier.
    replica_id: str | None = None
    lease_ttl_s: float = 30.0
    # a JSON line per step to this file (sched/trace.py): where requests' waits went
    trace_steps: Path | None = None

    def __post_init__(self) -> None:
        for name in ("kv_block_size", "max_batch_tokens", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kv_device_gb is not None and self.kv_device_gb <= 0:
            raise ValueError("kv_device_gb must be > 0")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.max_prefill_cost is not None and self.max_prefill_cost < 0:
            raise ValueError("max_prefill_cost must be >= 0 (0: no work cap)")
        if self.prefill_cost_scale is not None and self.prefill_cost_scale < 1:
            raise ValueError("prefill_cost_scale must be >= 1")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"overlap must be one of {', '.join(OVERLAP_MODES)}")
        if self.prefill_decode_ratio is not None and not self.prefill_decode_ratio >= 0:
            raise ValueError("prefill_decode_ratio must be >= 0 (0: no relative cap)")
        if self.itl_budget_factor is not None:
            check_factor(self.itl_budget_factor)
        if self.prefill_burst is not None and self.prefill_burst < 1:
            raise ValueError("prefill_burst must be >= 1 (1: off)")
        if self.blas not in BLAS_LIBRARIES:
            raise ValueError(f"blas must be one of {', '.join(BLAS_LIBRARIES)}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be >= 1")
        if self.cpu_threads_up_to is not None and not (
            self.cpu_threads is not None and self.cpu_threads_up_to > self.cpu_threads
        ):
            raise ValueError("cpu_threads_up_to must be more than cpu_threads")
        if self.cpu_linear not in CPU_LINEAR_MODES:
            raise ValueError(f"cpu_linear must be one of {', '.join(CPU_LINEAR_MODES)}")
        if self.cuda_graphs not in GRAPH_MODES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}")
        if self.graph_capture_s < 0:
            raise ValueError("graph_capture_s must be >= 0")
        if self.graph_chunks < 1:
            raise ValueError("graph_chunks must be >= 1")
        for name in ("kv_ram_gb", "kv_disk_gb", "coalesce_us", "kv_persist_idle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.restore_policy not in RESTORE_POLICIES:
            raise ValueError(f"restore_policy must be one of {', '.join(RESTORE_POLICIES)}")
        if not self.aging_s > 0:  # the queue divides by it (0 failed every step)
            raise ValueError("aging_s must be > 0")
        if self.replica_id is not None:
            validate_replica_id(self.replica_id)
            if self.kv_disk_dir is None:
                raise ValueError("--replica-id needs --kv-disk-dir (the shared store)")
            if not self.lease_ttl_s > 0:
                raise ValueError("lease_ttl_s must be > 0")


OVERLAP_MODES = ("auto", "on", "ahead", "off")

# Default max_prefill_tokens per device type: about what a step can prefill while decoders
# wait no more than a few decode steps (bench/sched.py part 2; docs/BENCHMARKS.md).
# CPU: 512 (and a work cap of 896) was measured too (docs/BENCHMARKS.md, "CPU prefill next to
# 16 decoders"): 2x tok/s on the smaller 16-agent workload, but on the full-size one no lower
# ITL p50, a 2.2x p95 and resumed turns 1.5x later, so 64 stays.
PREFILL_TOKENS = {"cuda": 512, "cpu": 64, "mps": 128}  # mps: not measured yet


def prefill_tokens(cfg: EngineConfig, device: torch.device) -> int:
    if cfg.max_prefill_tokens is not None:
        return cfg.max_prefill_tokens
    return PREFILL_TOKENS.get(device.type, PREFILL_TOKENS["cpu"])


def prefill_cost(
    cfg: EngineConfig, device: torch.device, chunk_sizes: tuple[int, ...] = ()
) -> PrefillCost | None:
    """The work cap on prompt chunks next to decoders (None when max_prefill_cost is 0)."""
    scale, budget = PREFILL_COST.get(device.type, PREFILL_COST["cpu"])
    if cfg.max_prefill_cost is not None:
        budget = cfg.max_prefill_cost
    if budget == 0:
        return None
    scale = cfg.prefill_cost_scale or scale
    ratio, row = RATIO_DEFAULTS.get(device.type, RATIO_DEFAULTS["cpu"])
    if cfg.prefill_decode_ratio is not None:
        ratio = cfg.prefill_decode_ratio
    return PrefillCost(scale, budget, chunk_sizes, decode_ratio=ratio, decode_row=row)


# Default prefill_burst per device type: how many short prompts' last chunks may start in one
# step next to decoders (sched/scheduler.py). CUDA: 8, measured on an H100 (docs/BENCHMARKS.md,
# "Multi-agent workload on the H200", run H): 32 / 64 agents' resumed turns started 1.7x /
# 1.3x sooner (p50; p95 1.9x / 5.2x) than with 1, at 1.10x / 1.21x the tok/s; 4 was close.
# With the default max_batch_tokens (2048) the step's token bound binds before 8 x 512.
# CPU, MPS: 1 (off), not measured: a CPU step is compute-bound and its ITL is the tight goal.
PREFILL_BURST = {"cuda": 8, "cpu": 1, "mps": 1}


def prefill_burst(cfg: EngineConfig, device: torch.device) -> int:
    if cfg.prefill_burst is not None:
        return cfg.prefill_burst
    return PREFILL_BURST.get(device.type, PREFILL_BURST["cpu"])


def itl_budget_factor(cfg: EngineConfig, device: torch.device) -> float:
    if cfg.itl_budget_factor is not None:
        return cfg.itl_budget_factor
    return FACTOR_DEFAULTS.get(device.type, FACTOR_DEFAULTS["cpu"])


def device_kv_bytes(cfg: EngineConfig, device: torch.device) -> int:
    if cfg.kv_device_gb is not None:
        return int(cfg.kv_device_gb * GB)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    return 2 * GB


class Engine:
    def __init__(
        self,
        cfg: EngineConfig,
        *,
        pool_observer: PoolObserver | None = None,
        sched_observer: SchedulerObserver | None = None,
        loaded: LoadedModel | None = None,
    ) -> None:
        self.cfg = cfg
        if loaded is None:
            device = select_device(cfg.device)
            dtype = select_dtype(cfg.dtype, device)
            loaded = load_model(
                cfg.model,
                device,
                dtype,
                show_progress=cfg.show_progress,
                cache_dir=cfg.cache_dir,
                tokenizer_dir=cfg.tokenizer,
            )
        self.loaded = loaded
        select_blas(cfg.blas, loaded.device)  # before the warm-up and graph captures
        if cfg.cpu_threads is not None and loaded.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)  # process-wide, as the BLAS choice
        # once, before the runner's warm-up; the packed weights replace the dense ones
        self.cpu_linear = pack_cpu_linears(
            loaded.model, cfg.cpu_linear, loaded.device, loaded.dtype
        )
        num_blocks = ModelRunner.blocks_for_bytes(
            loaded, cfg.kv_block_size, device_kv_bytes(cfg, loaded.device)
        )
        self.runner = ModelRunner(
            loaded,
            num_blocks=num_blocks,
            block_size=cfg.kv_block_size,
            backend=cfg.attention_backend,
            cuda_graphs=cfg.cuda_graphs,
            max_decode_batch=cfg.max_batch_size,
            # the chunks that run next to decoders get graphs (capped: each size is captured)
            max_graph_chunk=min(prefill_tokens(cfg, loaded.device), 2048),
            max_graph_chunks=cfg.graph_chunks,
        )
        # Before the pool and the worker exist: nothing else runs on the device yet.
        self.thread_probe: ThreadProbe | None = None
        if cfg.cpu_threads_up_to is not None and loaded.device.type == "cpu":
            assert cfg.cpu_threads is not None  # EngineConfig checks it
            scratch = self.runner.scratch_step()
            self.thread_probe = choose_threads(
                lambda: self.runner.step(scratch),
                cfg.cpu_threads,
                cfg.cpu_threads_up_to,
                torch.set_num_threads,
            )
        # one thread per core by the probe: a core goes back while other processes use one
        self.governor: ThreadGovernor | None = None
        probe = self.thread_probe
        if probe is not None and probe.chosen == probe.more:
            self.governor = ThreadGovernor(probe.fewer, probe.more, torch.set_num_threads)
        self.graph_capture = self.runner.capture_graphs(cfg.graph_capture_s)
        self.warm_up: WarmUpReport | None = None
        # Triton backends only: the torch references have no kernels to compile
        triton = self.runner.backend.name.startswith("triton")
        if cfg.eager_warm_up and loaded.device.type == "cuda" and triton:
            max_chunk = prefill_tokens(cfg, loaded.device)
            self.warm_up = self.runner.warm_up_eager(max_chunk, cfg.graph_capture_s)
        self.pool = SessionPool(
            PoolConfig(
                num_device_blocks=num_blocks,
                block_size=cfg.kv_block_size,
                ram_bytes=int(cfg.kv_ram_gb * GB),
                disk_dir=cfg.kv_disk_dir,
                disk_bytes=max(1, int(cfg.kv_disk_gb * GB)),
                persist_idle_s=cfg.kv_persist_idle_s,
                persist_every_tokens=cfg.kv_persist_every_tokens,
                acquire_timeout_s=cfg.session_wait_s,
                restore_policy=cfg.restore_policy,
                replica_id=cfg.replica_id,
                lease_ttl_s=cfg.lease_ttl_s,
            ),
            DeviceKV(self.runner.kv_caches, self.runner.layout),
            fingerprint_for(loaded),
            pool_observer,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_batch_tokens=cfg.max_batch_tokens,
                max_prefill_tokens=prefill_tokens(cfg, loaded.device),
                prefill_cost=prefill_cost(cfg, loaded.device, self.runner.graph_chunk_sizes),
                itl_budget_factor=itl_budget_factor(cfg, loaded.device),
                prefill_burst=prefill_burst(cfg, loaded.device),
                max_batch_size=cfg.max_batch_size,
                serialized=cfg.no_batching,
                session_wait_s=cfg.session_wait_s,
                queue=QueueConfig(
                    max_waiting=cfg.max_waiting,
                    max_waiting_per_tenant=cfg.max_waiting_per_tenant,
                    aging_s=cfg.aging_s,
                    weights=dict(cfg.tenant_weights),
                ),
            ),
            self.pool,
            self.runner,
            sched_observer,
        )
        # graphs left out of the start-up capture (or missed by a step) are captured when idle
        idle = self.runner.capture_pending_graph if self.graph_capture is not None else None
        mode = cfg.overlap
        if mode == "auto":
            mode = "ahead" if loaded.device.type == "cuda" else "off"
        self.worker = Worker(
            self.scheduler,
            cfg.coalesce_us,
            idle=idle,
            overlap=mode in ("on", "ahead"),
            ahead=mode == "ahead",
            trace=StepTrace(cfg.trace_steps) if cfg.trace_steps is not None else None,
            before_step=self.governor.tick if self.governor is not None else None,
        )
        self.worker.start()
        self._closed = False
        self._grammars: GrammarCache | None = None  # built on first use (imports xgrammar)
        self._grammars_lock = threading.Lock()

    @property
    def tokenizer(self):  # noqa: ANN201 - the model's Tokenizer
        return self.loaded.tokenizer

    def compile_constraint(self, spec: GrammarSpec) -> Constraint:
        """Compile (or fetch from the cache) a grammar for Request.constraint. Blocking and
        CPU-bound: call it from a worker thread, never on an event loop. Raises GrammarError."""
        with self._grammars_lock:
            if self._grammars is None:
                vocab = self.loaded.config.vocab_size
                self._grammars = GrammarCache(self.loaded.tokenizer, vocab)
            grammars = self._grammars
        return grammars.compile(spec)

    def submit(self, req: Request) -> RequestStream:
        return self.scheduler.submit(req)

    @property
    def trace(self) -> StepTrace | None:
        """The --trace-steps file's writer, None when off."""
        return self.worker.trace

    @property
    def cpu_threads(self) -> int | None:
        """The model's intra-op threads on CPU now (the probe's, or the governor's); None
        elsewhere."""
        if self.governor is not None:
            return self.governor.threads
        return torch.get_num_threads() if self.loaded.device.type == "cpu" else None

    @property
    def shares_store(self) -> bool:
        """Several replicas share the disk tier (--replica-id): see open_session."""
        return self.pool.tiers.store is not None

    def open_session(self, tenant: str, session_id: str | None) -> None:
        """Before submitting a request of a shared-store replica: claim the session's lease
        and find its snapshot if another replica wrote it (kv/pool.py open_from_store).
        Blocking file I/O: call it from a worker thread."""
        self.pool.open_from_store(tenant, session_id)

    def pin_prefix(self, tenant: str, token_ids: list[int], timeout: float = 600.0) -> PrefixInfo:
        """Pin a prefix (a system prompt's tokens) for a tenant's sessions to share, and
        compute it now if its blocks are not on the device (one request without a session).
        Blocking: call it from a worker thread. ValueError for a prefix that cannot be
        pinned (shorter than a block, ids outside the vocabulary, longer than the context)."""
        info = self.pool.pin_prefix(tenant, token_ids)
        if info.blocks_on_device < info.num_blocks:
            warm = Request(tenant=tenant, session_id=None, prompt_ids=token_ids, max_tokens=1)
            _, _, final = self.submit(warm).collect(timeout=timeout)
            if final.error is not None:
                self.pool.unpin_prefix(info.id)
                raise ValueError(f"the prefix could not be computed: {final.error}")
        return self.pool.prefix(info.id)

    def close(self, timeout: float = 30.0) -> None:
        """Stop accepting, let running requests finish (cancel them after `timeout`),
        stop the worker, flush sessions to disk."""
        if self._closed:
            return
        self._closed = True
        sched = self.scheduler
        with sched.wakeup:
            sched.accepting = False
        self.worker.stop(timeout)
        self.pool.close()
        if self.worker.trace is not None:
            self.worker.trace.close()
