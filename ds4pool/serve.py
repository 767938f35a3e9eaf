"""`ds4pool serve`: flags (each also read from a DS4POOL_* environment variable) → the app
on uvicorn. Flag parsing lives here so `cli.py` stays a thin dispatcher."""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ds4pool.errors import Ds4poolError
from ds4pool.output.detect import REASONING_FORMATS, TOOL_FORMATS
from ds4pool.threads import server_cpu_threads

_TRUE = ("1", "true", "yes", "on")
# GIL switch interval of a server process, µs (set_gil_switch says why not CPython's 5,000)
GIL_SWITCH_US = 200.0


def env_default(dest: str, fallback: Any) -> Any:
    """DS4POOL_<DEST> overrides a flag's default; argparse converts it with the flag's type."""
    return os.environ.get(f"DS4POOL_{dest.upper()}", fallback)


def _flag(p: argparse.ArgumentParser, name: str, **kw: Any) -> None:
    dest = name.lstrip("-").replace("-", "_")
    if kw.get("action") == "store_true":
        kw["default"] = str(env_default(dest, "")).lower() in _TRUE
    elif kw.get("action") == "append":
        raw = env_default(dest, None)
        kw["default"] = [v for v in raw.split(",") if v] if raw else []
    else:
        kw["default"] = env_default(dest, kw.get("default"))
    env = f"DS4POOL_{dest.upper()}"
    kw["help"] = f"{kw.get('help', '')} [env {env}]".strip()
    p.add_argument(name, **kw)


def _trace_file(path: Path | None) -> Path | None:
    """--trace-steps, checked now: a file that cannot be appended to is a one-line error at
    start-up, not a failure when the engine starts."""
    if path is not None:
        try:
            path.open("a").close()
        except OSError as exc:
            raise Ds4poolError(f"--trace-steps: {exc.strerror or exc}: {path}") from None
    return path


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    _flag(
        g,
        "--model",
        default="demo",
        help="'demo', 'random:PRESET' (100m, llama3-8b, qwen3-moe-70m, qwen3-30b-a3b), a local "
        "HF model directory, or 'scripted:RULES.json' (the scripted test model)",
    )
    _flag(
        g,
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer directory (tokenizer.json [+ tokenizer_config.json]) for random:* and "
        "scripted:* models (default: the demo tokenizer)",
    )
    _flag(g, "--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda[:N], mps")
    _flag(g, "--dtype", default="auto", help="auto, float32, bfloat16, float16")
    _flag(g, "--max-batch-tokens", type=int, default=2048, help="token budget per step")
    _flag(
        g,
        "--max-prefill-tokens",
        type=int,
        default=None,
        help="prompt tokens per step while others decode (default: 512 on CUDA, 64 on CPU)",
    )
    _flag(g, "--max-batch-size", type=int, default=64, help="sequences per step")
    _flag(
        g,
        "--coalesce-us",
        type=int,
        default=0,
        help="after idle, wait this long for more work before a step (0: off)",
    )
    _flag(
        g,
        "--overlap",
        default="auto",
        choices=["auto", "on", "ahead", "off"],
        help="write a step's results back while the device runs the next step; ahead: also "
        "launch a steady decode batch's next step before this one is read back "
        "(auto: ahead on CUDA, off elsewhere)",
    )
    _flag(
        g,
        "--no-batching",
        action="store_true",
        help="one request at a time, one live session (the serialized baseline)",
    )
    _flag(
        g,
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "triton-split", "triton-small"],
        help="paged attention: auto (triton on CUDA, torch elsewhere), torch, triton; "
        "triton-split: a mixed step's decode rows through the decode kernel; triton-small: "
        "through the prefill kernel on 16-row tiles (both opt-in)",
    )
    _flag(
        g,
        "--max-prefill-cost",
        type=int,
        default=None,
        help="prompt work per step while others decode, in tokens weighted by their context "
        "(1 + position / --prefill-cost-scale each; default: 640 on CUDA, 112 on CPU; 0: off)",
    )
    _flag(
        g,
        "--prefill-decode-ratio",
        type=float,
        default=None,
        help="while others decode, a step's prompt work is also at most this x the decoders' "
        "own work, so a mixed step costs ~(1 + ratio) x a decode step (e.g. 0.5 on CPU for "
        "smoother decode at few sequences, slower prompts; default and 0: off)",
    )
    _flag(
        g,
        "--itl-budget-factor",
        type=float,
        default=None,
        help="while others decode, a step's prompt work is also at most what keeps the step "
        "within this x a decode step, from measured step times (default 0: off; else > 1)",
    )
    _flag(
        g,
        "--prefill-burst",
        type=int,
        default=None,
        help="while others decode, up to N short prompts (each within the token and work "
        "caps) may start in one step, N x the caps in all; a longer prompt's chunks keep the "
        "single caps (default: 8 on CUDA, 1 (off) on CPU)",
    )
    _flag(
        g,
        "--prefill-cost-scale",
        type=int,
        default=None,
        help="context at which a prompt token's attention costs as much as its GEMMs "
        "(default: 4096)",
    )
    _flag(
        g,
        "--blas",
        default="auto",
        choices=["auto", "default", "cublas", "cublaslt"],
        help="CUDA: torch's preferred BLAS library for the projections (auto: cublaslt on "
        "CUDA, measured 1.03-1.04x faster decode on the H200; default: torch's own choice)",
    )
    _flag(
        g,
        "--cpu-linear",
        default="auto",
        choices=["auto", "onednn", "torch"],
        help="CPU: run the projections through oneDNN prepacked weights (auto, the default: "
        "onednn on CPU in float32, measured faster batched decode on AMD CPUs where MKL is "
        "slow, F.linear elsewhere; torch: F.linear)",
    )
    _flag(
        g,
        "--cpu-threads",
        default="auto",
        help="CPU: torch's threads for the model (auto, the default: one per core but one, "
        "which the HTTP side keeps, unless a start-up probe times a step with one per core "
        "at most 0.85x as long; an exported OMP_NUM_THREADS wins over auto; N: N threads)",
    )
    _flag(
        g,
        "--cuda-graphs",
        default="ahead",
        choices=["ahead", "lazy", "eager"],
        help="CUDA graphs of decode and mixed steps: ahead (captured at start-up), lazy (on "
        "first use), eager (none)",
    )
    _flag(
        g,
        "--graph-capture-s",
        type=float,
        default=120.0,
        help="longest start-up capture (ahead); graphs left out are captured when idle. "
        "The eager warm-up that follows gets as long again",
    )
    _flag(
        g,
        "--graph-chunks",
        type=int,
        default=1,
        help="CUDA: a step of decodes and up to N prompt chunks replays a mixed-step graph "
        "(their tokens together padded to a chunk bucket); 1: only single-chunk steps, "
        "several chunks run eagerly",
    )
    _flag(
        g,
        "--no-eager-warm-up",
        action="store_true",
        help="CUDA: skip the start-up run of the eager steps' kernel variants (a step that "
        "needs one not compiled yet then compiles it while serving)",
    )
    _flag(
        g,
        "--no-cuda-graphs",
        action="store_true",
        help="run every step eagerly (same as --cuda-graphs eager)",
    )
    k = p.add_argument_group("session pool")
    _flag(
        k,
        "--kv-device-gb",
        type=float,
        default=None,
        help="device KV pool (default: 85%% of free GPU memory, 2 GB on CPU)",
    )
    _flag(k, "--kv-block-size", type=int, default=16, help="tokens per KV block")
    _flag(k, "--kv-ram-gb", type=float, default=4.0, help="RAM tier budget")
    _flag(
        k,
        "--kv-disk-dir",
        type=Path,
        default=None,
        help="disk tier directory (sessions survive restarts); default: none",
    )
    _flag(k, "--kv-disk-gb", type=float, default=32.0, help="disk tier budget")
    _flag(
        k,
        "--replica-id",
        default=None,
        help="this replica's name when several share --kv-disk-dir as one snapshot store "
        "(session leases, docs/OPERATIONS.md); default: a private disk tier",
    )
    _flag(
        k,
        "--lease-ttl-s",
        type=float,
        default=30.0,
        help="a session's store lease expires this long after its last use (--replica-id)",
    )
    _flag(
        k,
        "--kv-persist-idle-s",
        type=float,
        default=30.0,
        help="persist a session idle this long (0: off)",
    )
    _flag(
        k,
        "--kv-persist-every-tokens",
        type=int,
        default=4096,
        help="persist a session every N new tokens (0: off)",
    )
    _flag(
        k,
        "--restore-policy",
        default="auto",
        choices=["auto", "always", "never"],
        help="a returning session's KV in RAM or on disk: auto = read it back or recompute "
        "it, whichever the measured rates say is faster; always = read; never = recompute",
    )
    q = p.add_argument_group("queue")
    _flag(q, "--max-waiting", type=int, default=1024, help="waiting requests, all tenants")
    _flag(q, "--max-waiting-per-tenant", type=int, default=256, help="waiting per tenant")
    _flag(
        q,
        "--aging-s",
        type=float,
        default=10.0,
        help="waiting this long lifts a request one priority level",
    )
    _flag(
        q,
        "--session-wait-s",
        type=float,
        default=120.0,
        help="how long a request waits for its busy session",
    )


def add_server_flags(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("server")
    _flag(s, "--host", default="127.0.0.1")
    _flag(s, "--port", type=int, default=8000)
    _flag(
        s,
        "--api-key",
        action="append",
        help="an API key; each is its own tenant (repeatable; env: comma-separated)",
    )
    _flag(
        s,
        "--api-keys-file",
        type=Path,
        default=None,
        help='JSON {"KEY": {"tenant": ..., "priority": 0, "weight": 1, "max_concurrent": 0}}',
    )
    _flag(s, "--admin-token", default=None, help="bearer token for /admin (off when unset)")
    _flag(s, "--metrics-auth", action="store_true", help="/metrics requires the admin token")
    _flag(s, "--max-body-mb", type=float, default=16.0, help="largest request body")
    _flag(s, "--served-model-name", default=None, help="model id reported by /v1/models")
    _flag(
        s,
        "--request-timeout-s",
        type=float,
        default=0.0,
        help="cancel requests running longer (0: no limit)",
    )
    _flag(s, "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _flag(
        s,
        "--gil-switch-us",
        type=float,
        default=GIL_SWITCH_US,
        help="how long a thread running Python keeps the GIL while another waits for it, µs "
        "(CPython: 5000). The step thread takes it back after each of a step's launches; "
        "the API's threads hold it while they parse and render requests",
    )
    _flag(
        s,
        "--http",
        default="auto",
        choices=["auto", "httptools", "h11"],
        help="HTTP/1.1 implementation: httptools (C, a dependency of ds4pool) or h11 (pure "
        "Python: its parsing and framing run on the event loop, under the GIL the step "
        "thread needs); auto: httptools where installed",
    )
    _flag(
        s,
        "--loop",
        default="auto",
        choices=["auto", "uvloop", "asyncio"],
        help="event loop: uvloop (libuv, a dependency of ds4pool where it builds) or asyncio's "
        "own; auto: uvloop where installed",
    )
    _flag(
        s,
        "--trace-steps",
        type=Path,
        default=None,
        help="append a JSON line per step to this file: its rows, prompt chunks and times, "
        "and when each request arrived and was admitted (a diagnostic: where a first token's "
        "wait went; bench/trace_report.py reads it)",
    )
    _flag(
        s,
        "--drain-grace-s",
        type=float,
        default=0.0,
        help="on SIGTERM, answer /ready 503 this long before closing the listener, so a load "
        "balancer's health check takes the replica out first",
    )
    o = p.add_argument_group("model output")
    _flag(
        o,
        "--tool-parser",
        default="auto",
        choices=["auto", *TOOL_FORMATS],
        help="tool-call format of the model's output (auto: from its chat template and tokens)",
    )
    _flag(
        o,
        "--reasoning-parser",
        default="auto",
        choices=["auto", *REASONING_FORMATS],
        help="reasoning blocks (<think>) in the model's output (auto: from its template/tokens)",
    )


def _torch_threads() -> int:
    """torch's intra-op thread count as it stands (one per core unless configured)."""
    import torch

    return torch.get_num_threads()


def build_config(args: argparse.Namespace):  # noqa: ANN201 - ServerConfig
    from ds4pool.api.config import ServerConfig, api_keys_from
    from ds4pool.engine import EngineConfig
    from ds4pool.output.processor import OutputConfig

    keys = api_keys_from(args.api_key, args.api_keys_file)
    try:
        threads = server_cpu_threads(args.cpu_threads, _torch_threads(), os.environ)
        engine = EngineConfig(
            model=args.model,
            tokenizer=args.tokenizer,
            device=args.device,
            dtype=args.dtype,
            kv_device_gb=args.kv_device_gb,
            kv_block_size=args.kv_block_size,
            kv_ram_gb=args.kv_ram_gb,
            kv_disk_dir=args.kv_disk_dir,
            kv_disk_gb=args.kv_disk_gb,
            kv_persist_idle_s=args.kv_persist_idle_s,
            kv_persist_every_tokens=args.kv_persist_every_tokens,
            restore_policy=args.restore_policy,
            replica_id=args.replica_id or None,
            lease_ttl_s=args.lease_ttl_s,
            max_batch_tokens=args.max_batch_tokens,
            max_prefill_tokens=args.max_prefill_tokens,
            max_prefill_cost=args.max_prefill_cost,
            prefill_cost_scale=args.prefill_cost_scale,
            prefill_decode_ratio=args.prefill_decode_ratio,
            itl_budget_factor=args.itl_budget_factor,
            prefill_burst=args.prefill_burst,
            max_batch_size=args.max_batch_size,
            coalesce_us=args.coalesce_us,
            overlap=args.overlap,
            no_batching=args.no_batching,
            attention_backend=args.attention_backend,
            blas=args.blas,
            cpu_linear=args.cpu_linear,
            cpu_threads=threads.count,
            cpu_threads_up_to=threads.up_to,
            cuda_graphs="eager" if args.no_cuda_graphs else args.cuda_graphs,
            graph_capture_s=args.graph_capture_s,
            eager_warm_up=not args.no_eager_warm_up,
            graph_chunks=args.graph_chunks,
            max_waiting=args.max_waiting,
            max_waiting_per_tenant=args.max_waiting_per_tenant,
            aging_s=args.aging_s,
            session_wait_s=args.session_wait_s,
            tenant_weights={t.name: t.weight for t in keys.values()},
            show_progress=sys.stderr.isatty(),
            trace_steps=_trace_file(args.trace_steps),
        )
        output = OutputConfig(tool_parser=args.tool_parser, reasoning_parser=args.reasoning_parser)
    except ValueError as exc:
        raise Ds4poolError(str(exc)) from None
    return ServerConfig(
        engine=engine,
        host=args.host,
        port=args.port,
        api_keys=keys,
        admin_token=args.admin_token or None,
        metrics_auth=args.metrics_auth,
        max_body_mb=args.max_body_mb,
        served_model_name=args.served_model_name,
        request_timeout_s=args.request_timeout_s,
        output=output,
    )


def set_gil_switch(us: float) -> None:
    """The process's GIL switch interval (`sys.setswitchinterval`). The step thread releases
    the GIL around each of its launches (hundreds in an eager step) and must take it back
    each time; while an API thread runs Python (a wave of requests parsed and rendered),
    CPython hands it back only after that thread has held it for the interval. At 5 ms a
    demo step beside a thread rendering chat templates ran 1,264x slower than alone, at
    200 µs 35x, the renders 3-10% fewer a second (bench/gil_convoy.py; docs/BENCHMARKS.md)."""
    if not us > 0:
        raise Ds4poolError(f"--gil-switch-us must be > 0, not {us:g}")
    sys.setswitchinterval(us / 1e6)  # (us * 1e-6 would be 199 µs: CPython truncates)


def check_http_stack(http: str, loop: str) -> None:
    """--http / --loop name a module that is installed (uvicorn would fail with a traceback)."""
    for flag, name in (("--http", http), ("--loop", loop)):
        if name in ("httptools", "uvloop") and importlib.util.find_spec(name) is None:
            raise Ds4poolError(f"{flag} {name}: the {name} package is not installed")


def http_stack(http: str, loop: str) -> str:
    """What uvicorn's "auto" picks, for the start-up log: e.g. "httptools on uvloop"."""
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return f"{http} on {loop}"


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ds4pool.api.app import create_app
    from ds4pool.serve_drain import DrainingServer

    cfg = build_config(args)
    set_gil_switch(args.gil_switch_us)
    check_http_stack(args.http, args.loop)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    metrics = _metrics(cfg)
    # Bind the port, then load the model, before serving: a taken port, a bad --model or an
    # unusable --kv-disk-dir fail with one line (the port first: it fails fast). The socket
    # listens only once uvicorn serves, so clients are refused until the server can serve.
    sock = _bind(cfg.host, cfg.port)
    try:
        engine = _start_engine(cfg, metrics)
    except BaseException:
        sock.close()
        raise
    app = create_app(cfg, engine, metrics=metrics, own_engine=True)
    freeze_startup_objects()
    logging.getLogger("ds4pool.serve").info(
        "%d start-up objects moved out of the garbage collector's reach (gc.freeze); GIL "
        "switch interval %g µs; HTTP %s",
        gc.get_freeze_count(),
        round(sys.getswitchinterval() * 1e6),
        http_stack(args.http, args.loop),
    )
    server = DrainingServer(
        uvicorn.Config(
            app,
            http=args.http,
            loop=args.loop,
            log_level=args.log_level,
            timeout_graceful_shutdown=30,
            access_log=False,
        ),
        app.state.api,
        args.drain_grace_s,
    )
    with _sigterm_is_a_clean_stop():
        server.run(sockets=[sock])
    return 0 if server.started else 1  # uvicorn logged why the lifespan did not start


def freeze_startup_objects() -> None:
    """What the start-up made (the model's modules, the tokenizer, the app's routes) lives as
    long as the server: collect the start-up's garbage, then move the rest out of the garbage
    collector's generations (`gc.freeze`), so that a full collection while serving walks only
    what serving made. The collector stops every thread, the step thread included, for a
    full walk of the heap (bench/gc_pause.py; docs/BENCHMARKS.md)."""
    gc.collect()
    gc.freeze()


def _start_engine(cfg: Any, metrics: Any) -> Any:
    """The engine, or one line for what an operator must fix (a read-only or locked
    --kv-disk-dir, an unwritable cache directory...)."""
    from ds4pool.api.app import build_engine
    from ds4pool.kv.disk_files import DirectoryLockedError

    try:
        return build_engine(cfg, metrics)
    except DirectoryLockedError as exc:
        raise Ds4poolError(f"--kv-disk-dir: {exc} (is another server using it?)") from None
    except OSError as exc:
        raise Ds4poolError(f"cannot start: {exc}") from None


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds it (asyncio makes it listen when serving
    starts); a taken port is one line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Ds4poolError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


@contextlib.contextmanager
def _sigterm_is_a_clean_stop() -> Iterator[None]:
    """uvicorn drains on SIGTERM, then re-raises the signal to the handler it found, which
    by default kills the process with -15. A handler that does nothing makes a drained
    server exit 0 (systemd and Kubernetes read -15 as a failure)."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _metrics(cfg: Any) -> Any:
    from ds4pool.metrics import Metrics

    return Metrics()
