"""The scheduler's settings and its metrics hooks: what engine, metrics and benches name."""

from __future__ import annotations

from dataclasses import dataclass, field

from ds4pool.sched.prefill_cost import PrefillCost
from ds4pool.sched.queue import QueueConfig
from ds4pool.sched.seq import Seq


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 2048
    # Prompt tokens per step while some sequence decodes (a lone prompt uses the full
    # max_batch_tokens): bounds how long a prefill chunk stalls the decoders.
    max_prefill_tokens: int = 2048
    # ... and at most this much prompt work (tokens weighted by their context); None: off
    prefill_cost: PrefillCost | None = None
    # ... lowered so that a mixed step lasts <= this x a decode step, from measured step
    # times (sched/step_time.py; needs prefill_cost); 0: off
    itl_budget_factor: float = 0.0
    # ... and up to this x both caps for prompts' last chunks that fit the single caps alone
    # (a burst of short prompts starts in one step; a long prompt keeps the single caps)
    prefill_burst: int = 1
    max_batch_size: int = 64
    serialized: bool = False  # --no-batching: one request at a time, one live session
    session_wait_s: float = 120.0  # how long a request may wait for its busy session
    queue: QueueConfig = field(default_factory=QueueConfig)

    def __post_init__(self) -> None:
        if self.prefill_burst < 1:
            raise ValueError("prefill_burst must be >= 1 (1: off)")


class SchedulerObserver:
    """Hooks for metrics; the default does nothing."""

    def step(
        self, batch_size: int, num_tokens: int, seconds: float, host_seconds: float = 0.0
    ) -> None: ...

    def prefill_budget(self, work: float) -> None:
        """The prompt work (token-equivalents) a step next to decoders was allowed."""

    def prefill_burst(self, chunks: int) -> None:
        """A step took `chunks` prompts' last chunks in its burst room (--prefill-burst)."""

    def admitted(self, queue_wait_s: float) -> None: ...

    def token(self, seq: Seq, first: bool, seconds: float) -> None: ...

    def finished(self, seq: Seq, reason: str) -> None: ...

    def preempted(self) -> None: ...

    def rejected(self, reason: str) -> None: ...
