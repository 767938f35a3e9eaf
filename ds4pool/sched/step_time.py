"""A step's prompt budget from measured step time: the ITL a decoder pays for a prompt chunk.

The work model (sched/prefill_cost.py) says how much one chunk costs relative to another; it
does not say how long a unit of that work takes on this device, nor how long the decode step
it joins lasts. Both are learnt here, online, from the StepSamples the worker already emits
(Sarathi-Serve's idea: the token budget follows from the inter-token latency one will pay):

    decode_s(rows)  EWMA of a decode-only step's seconds, per number of decode rows
    s_per_work      EWMA over mixed steps of (seconds - decode_s(rows)) / prompt work;
                    until the first mixed step, seconds / work of prompt-only steps

While sequences decode, a step's prompt work is at most

    (factor - 1) x decode_s(rows) / s_per_work        clamped to [floor, cap]

so a mixed step lasts about `factor` decode steps: its decoders' ITL is <= factor x their ITL
without the prompt. `cap` is the work cap of that step (--max-prefill-cost, lowered by
--prefill-decode-ratio); `floor` keeps a prompt advancing (PrefillCost.chunk also lets a
step's first chunk take min_chunk tokens whatever the budget). Until a decode-only step and
a step with prompt work are measured, the cap applies unchanged, as it does with no decoders
(the scheduler then sets no work budget at all) and with factor 0 (off). A prompt-only step
(larger chunks, no decoders) runs its work faster per unit than a chunk next to decoders: its
rate is only the first guess, so that the first mixed step does not take the whole cap (one
such step is 8 of a decoder's gaps at once: the p99 of a short prefill); the first mixed step
replaces it.

A fixed overhead per mixed step (a prefill launch) makes small chunks look expensive per unit;
the budget still settles where a step lasts factor x decode_s: at W, the next budget is
c*W / (O + r*W) (c = (factor - 1) decode_s, O overhead, r true s/unit), whose fixed point
O + r*W = c is stable (slope O / c < 1). But only if O < c: when a mixed step's fixed cost
beyond a decode step is more than the factor allows, there is no fixed point and the budget
sinks to the floor. That is what 32 agents on the H200 showed (docs/BENCHMARKS.md, "prefill
budget from measured step time"): seconds per unit doubled, the budget fell from the 896 cap
to ~56 units a step, and gen tok/s fell 4.4x. Hence off by default everywhere.

Decode time is keyed by rows only, not by context: a decode estimate from shorter contexts
makes the prompt look costlier (a smaller budget, the safe side). Used on the worker thread
only (observe after a step, budget while building the next): no lock.
"""

from __future__ import annotations

from ds4pool.kv.cost import Ewma, StepSample

# Per device type: the ITL budget factor (0: off). Off everywhere (docs/BENCHMARKS.md, "The
# prefill budget from measured step time"). CUDA: on the H200, 2.5 took bench/sched.py part 2
# from 3.4-3.6x to 2.9-3.4x, but starved 32 agents' prompts (gen tok/s 1,625 -> 367, resumed
# TTFT p50 287 -> 2,452 ms): eager mixed steps cost more over a decode graph than 1.5 decode
# steps. CPU: a relative prompt budget starved prompts on the 16-agent workload before
# (--prefill-decode-ratio, docs/BENCHMARKS.md "CPU prefill next to 16 decoders").
FACTOR_DEFAULTS: dict[str, float] = {"cuda": 0.0, "cpu": 0.0, "mps": 0.0}

ALPHA = 0.25  # weight of the newest sample, as kv/cost.py's rates
MIN_SECONDS = 1e-4  # a shorter step is timer noise and fixed overhead: ignored


def check_factor(factor: float) -> None:
    if not (factor == 0 or factor > 1):
        raise ValueError("itl_budget_factor must be 0 (off) or > 1")


class StepTime:
    """Decode-step seconds per decode rows and seconds per unit of prompt work, learnt from
    StepSamples; `budget` turns them into a step's prompt work under `factor`."""

    def __init__(self, factor: float, alpha: float = ALPHA) -> None:
        check_factor(factor)
        self.factor = factor
        self.alpha = alpha
        self._decode: dict[int, Ewma] = {}  # decode rows → decode-only step seconds
        self._per_work = Ewma(0.0, alpha)  # seconds per token-equivalent of prompt work
        self._alone = Ewma(0.0, alpha)  # ... in prompt-only steps: the first guess

    def observe(self, sample: StepSample) -> None:
        rows = sample.num_decode_rows
        if sample.seconds < MIN_SECONDS:
            return
        if rows == 0:
            if sample.prefill_work > 0:
                self._alone.observe(sample.seconds / sample.prefill_work)
            return
        if sample.num_prefill_tokens == 0:
            self._decode.setdefault(rows, Ewma(0.0, self.alpha)).observe(sample.seconds)
            return
        decode = self.decode_s(rows)
        if decode is None or sample.prefill_work <= 0:
            return  # the decoders' share of this step is unknown: nothing to attribute
        # at least a tenth of the step is the prompt's (as kv/cost.py): a decode estimate
        # from a quieter moment must not make prompt work look free
        prompt_s = max(sample.seconds - decode, 0.1 * sample.seconds)
        self._per_work.observe(prompt_s / sample.prefill_work)

    def decode_s(self, rows: int) -> float | None:
        """A decode-only step's seconds at `rows` rows, from the nearest measured row count
        (the larger on a tie); None before any decode-only step."""
        if not self._decode:
            return None
        near = min(self._decode, key=lambda r: (abs(r - rows), -r))
        return self._decode[near].value

    @property
    def seconds_per_work(self) -> float | None:
        """Measured next to decoders, else in prompt-only steps; None before either."""
        for rate in (self._per_work, self._alone):
            if rate.measured:
                return rate.value
        return None

    def budget(self, decode_rows: int, cap: float, floor: float) -> float:
        """Prompt work for a step next to `decode_rows` decoders: cap when off or unmeasured,
        else (factor - 1) x decode_s / s_per_work within [floor, cap]."""
        if not self.factor or decode_rows == 0:
            return cap
        decode, per_work = self.decode_s(decode_rows), self.seconds_per_work
        if decode is None or not per_work:
            return cap
        return min(cap, max(floor, (self.factor - 1) * decode / per_work))
