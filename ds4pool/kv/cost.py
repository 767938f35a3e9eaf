"""Restore vs recompute: is a returning session's missing KV cheaper to read back from its
tier or to prefill again?

    read time      = bytes / rate(tier)                 ram:  the host → device copy
                   (+ bytes / rate(ram) for disk)       disk: file read + checksum + decode,
                                                              then the host → device copy
    recompute time = tokens / prefill rate
    choice         = the smaller one (ties read: no work is thrown away)

The rates are measured on the moves the pool already makes (each restore's copy, each
snapshot read) and on the engine's steps (`StepSample`: counts and times, no model
objects), smoothed by an EWMA, with conservative priors until the first measurement: the
priors favour reading, today's behaviour. `RestorePolicy` can force either side
(`--restore-policy always|never`), for tests and for users who know their hardware.

No torch here and no I/O: the pool calls `decide()` with counts and applies the choice.
Thread-safe: steps are observed on the worker thread, reads on the prefetch thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum


class RestorePolicy(str, Enum):
    AUTO = "auto"  # the cheaper of reading and recomputing, from the measured rates
    ALWAYS = "always"  # always read the KV back (never recompute what a tier holds)
    NEVER = "never"  # never read KV back from RAM or disk: recompute it


class Choice(str, Enum):
    READ = "read"
    RECOMPUTE = "recompute"


READ_TIERS = ("ram", "disk")  # where a restore reads from (the metrics' `tier` label)


@dataclass(frozen=True)
class CostPriors:
    """Rates assumed before the first measurement, and the EWMA weight of a new sample.
    Reading priors are on the fast side and prefill on the slow side, so that an
    unmeasured pool keeps restoring as it did before this model existed."""

    ram_bytes_per_s: float = 4e9
    disk_bytes_per_s: float = 1e9
    prefill_tokens_per_s: float = 500.0
    alpha: float = 0.25  # weight of the newest sample (≈ the last 4–8 samples count)
    # a sample shorter than this is mostly timer noise and fixed overhead: ignored
    min_seconds: float = 1e-4


@dataclass(frozen=True)
class StepSample:
    """One engine step, as the worker saw it: tokens computed for prompts (or recomputed
    KV) vs decode rows, and the step's wall time."""

    num_prefill_tokens: int
    num_decode_rows: int
    seconds: float
    # the prompt tokens' work in PrefillCost token-equivalents (sched/prefill_cost.py); 0:
    # not modelled (no work cap). sched/step_time.py learns seconds per unit from it.
    prefill_work: float = 0.0


@dataclass(frozen=True)
class CostRates:
    ram_bytes_per_s: float
    disk_bytes_per_s: float
    prefill_tokens_per_s: float
    measured: frozenset[str]  # which of "ram", "disk", "prefill" have a measurement


@dataclass(frozen=True)
class RestoreDecision:
    tier: str  # "ram" or "disk": where the KV would be read from
    choice: Choice
    num_tokens: int  # tokens of KV missing on the device
    num_bytes: int
    read_s: float  # expected, from the rates at decision time
    recompute_s: float


class Ewma:
    """An exponentially weighted mean with a prior (also sched/step_time.py's)."""

    def __init__(self, prior: float, alpha: float) -> None:
        self.value, self.alpha, self.measured = prior, alpha, False

    def observe(self, x: float) -> None:
        # the first sample replaces the prior outright: the prior is a guess, not a sample
        self.value = x if not self.measured else self.alpha * x + (1 - self.alpha) * self.value
        self.measured = True


class RestoreCost:
    def __init__(
        self, policy: RestorePolicy = RestorePolicy.AUTO, priors: CostPriors | None = None
    ) -> None:
        self.policy = policy
        self.priors = p = priors or CostPriors()
        self._lock = threading.Lock()
        self._read = {
            "ram": Ewma(p.ram_bytes_per_s, p.alpha),
            "disk": Ewma(p.disk_bytes_per_s, p.alpha),
        }
        self._prefill = Ewma(p.prefill_tokens_per_s, p.alpha)
        # seconds of a step with decode rows only: subtracted from a mixed step so that the
        # prefill rate is the marginal cost of prompt tokens, not the decoders' share
        self._decode_step = Ewma(0.0, p.alpha)

    # ------------------------------------------------------------ measurements

    def observe_read(self, tier: str, num_bytes: int, seconds: float) -> None:
        """A tier move that happened: num_bytes of KV read from `tier` in `seconds`."""
        assert tier in READ_TIERS, tier
        if num_bytes <= 0 or seconds < self.priors.min_seconds:
            return
        with self._lock:
            self._read[tier].observe(num_bytes / seconds)

    def observe_step(self, sample: StepSample) -> None:
        if sample.seconds < self.priors.min_seconds:
            return
        with self._lock:
            if sample.num_prefill_tokens == 0:
                if sample.num_decode_rows:
                    self._decode_step.observe(sample.seconds)
                return
            seconds = sample.seconds
            if sample.num_decode_rows and self._decode_step.measured:
                # at least a tenth of the step is the prompt's: a decode estimate from a
                # quieter moment must not make prompt tokens look free
                seconds = max(seconds - self._decode_step.value, 0.1 * seconds)
            self._prefill.observe(sample.num_prefill_tokens / seconds)

    def rates(self) -> CostRates:
        with self._lock:
            measured = {t for t, e in self._read.items() if e.measured}
            if self._prefill.measured:
                measured.add("prefill")
            return CostRates(
                self._read["ram"].value,
                self._read["disk"].value,
                self._prefill.value,
                frozenset(measured),
            )

    # ------------------------------------------------------------ the decision

    def decide(self, tier: str, num_tokens: int, num_bytes: int) -> RestoreDecision:
        """Read `num_tokens` of KV (`num_bytes`) back from `tier`, or recompute them?"""
        assert tier in READ_TIERS, tier
        r = self.rates()
        read_s = num_bytes / r.ram_bytes_per_s
        if tier == "disk":
            read_s += num_bytes / r.disk_bytes_per_s
        recompute_s = num_tokens / r.prefill_tokens_per_s
        if self.policy is RestorePolicy.ALWAYS:
            choice = Choice.READ
        elif self.policy is RestorePolicy.NEVER:
            choice = Choice.RECOMPUTE if num_tokens else Choice.READ
        else:
            choice = Choice.RECOMPUTE if recompute_s < read_s else Choice.READ
        return RestoreDecision(tier, choice, num_tokens, num_bytes, read_s, recompute_s)
