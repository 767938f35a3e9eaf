"""A real uvicorn server on loopback, serving the demo model, for the official SDKs."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import uvicorn

from ds4pool.api.app import create_app
from ds4pool.api.config import ServerConfig
from ds4pool.engine import Engine, EngineConfig
from ds4pool.metrics import Metrics
from ds4pool.model.loader import LoadedModel, load_model


@dataclass
class Server:
    url: str
    engine: Engine
    cfg: ServerConfig


@pytest.fixture(scope="session")
def loaded(demo_dir: Path) -> LoadedModel:
    return load_model(str(demo_dir), torch.device("cpu"), torch.float32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def serve(loaded: LoadedModel) -> Iterator[Callable[..., Server]]:
    """Start servers (one per distinct config in a module); all stopped at module end."""
    running: list[tuple[uvicorn.Server, threading.Thread, Engine]] = []

    def start(
        engine_kw: dict | None = None, *, metrics: bool = False, **server_kw: object
    ) -> Server:
        """`metrics`: Prometheus metrics at /metrics, as `ds4pool serve` has them."""
        engine_cfg = EngineConfig(**{"kv_device_gb": 0.05, **(engine_kw or {})})
        m = Metrics() if metrics else None
        engine = Engine(
            engine_cfg,
            loaded=loaded,
            pool_observer=m.pool_observer() if m else None,
            sched_observer=m.scheduler_observer() if m else None,
        )
        if m is not None:
            m.bind(engine)
        cfg = ServerConfig(engine=engine_cfg, port=free_port(), **server_kw)  # type: ignore[arg-type]
        app = create_app(cfg, engine, metrics=m, own_engine=False)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=cfg.port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        running.append((server, thread, engine))
        return Server(f"http://127.0.0.1:{cfg.port}", engine, cfg)

    yield start
    for server, thread, engine in running:
        server.should_exit = True
        thread.join(timeout=10)
        engine.close()


def scripted_qwen3(tmp: Path, rules: list[dict[str, Any]]) -> LoadedModel:
    """The scripted test model with the real Qwen3 tokenizer (skips where it is absent),
    its rules written under `tmp`: what the modules testing structured output load."""
    from tests.real_tokenizers import real_tokenizer_dir

    path = tmp / "rules.json"
    path.write_text(json.dumps(rules))
    qwen3 = real_tokenizer_dir("qwen3")
    return load_model(f"scripted:{path}", torch.device("cpu"), torch.float32, tokenizer_dir=qwen3)
