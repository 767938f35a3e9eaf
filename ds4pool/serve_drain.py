"""The drain of `ds4pool serve` on SIGTERM, for a replica behind a load balancer.

uvicorn alone stops listening at once, so a balancer sees connection failures rather than a
replica going out of rotation. Here SIGTERM first marks the server draining: /ready answers
503 (the balancer's health check takes the replica out) and new generation requests get 503
with Retry-After (a balancer may retry them on another replica: they never ran). After
`grace_s`, uvicorn's graceful shutdown runs: stop listening, let running requests finish,
then the lifespan closes the engine (flush every session to the store, release the session
leases). A second SIGTERM, or SIGINT, skips the rest of the grace.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

import uvicorn

log = logging.getLogger("ds4pool.serve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, api_state: Any, grace_s: float) -> None:
        super().__init__(config)
        self.api_state = api_state  # ds4pool.api.common.ApiState: its `draining` flag
        self.grace_s = grace_s
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.api_state.draining = True
        if self._timer is None and sig == signal.SIGTERM and self.grace_s > 0:
            log.info(
                "SIGTERM: draining (/ready 503) for %.1fs, then finishing requests", self.grace_s
            )
            self._timer = threading.Timer(self.grace_s, super().handle_exit, (sig, None))
            self._timer.daemon = True
            self._timer.start()
            return
        if self._timer is not None:
            self._timer.cancel()
        super().handle_exit(sig, frame)
