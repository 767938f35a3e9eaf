"""The step under construction: which sequences run, how many tokens each, and their rows.

The scheduler (sched/scheduler.py) decides who runs and reserves blocks; this module only
sizes a sequence's chunk under the step's budgets and turns (seq, n) into the runner's
`SeqInput`. Nothing here touches the queue, the pool or a session beyond reading the lease's
block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ds4pool.kv.cost import StepSample
from ds4pool.model.runner import SeqInput
from ds4pool.sched.prefill_cost import PrefillCost
from ds4pool.sched.seq import Seq

if TYPE_CHECKING:  # the scheduler itself never touches tensors: a bitmask passes through
    import torch


_PLACEHOLDER = (0,)  # a fed row's input id until the runner overwrites it on the device


@dataclass
class Step:
    seqs: list[Seq]
    inputs: list[SeqInput]
    counts: list[int]  # tokens computed per seq
    # prompt work left (PrefillCost token-equivalents) while others decode; None: no cap
    work_left: float | None = None
    prompt_chunks: int = 0  # chunks sized under work_left so far (the first is rounded)
    # While others decode: prompt tokens left for chunks (None: nobody decodes, only the
    # caller's token budget), and the burst room (sched/scheduler.py, --prefill-burst) that
    # only a prompt's last chunk may use, and only one that would fit the single caps alone
    # (<= cap_tokens and <= cap_work): a burst of short prompts joins one step, while a long
    # prompt's chunks keep the single caps.
    tokens_left: int | None = None
    burst_tokens: int = 0
    burst_work: float = 0.0
    cap_tokens: int = 0
    cap_work: float = 0.0
    burst_chunks: int = 0  # prompts' last chunks that took burst room (the metric's count)
    # (tenant, tokens) of the rows added and not yet charged to the queue (the scheduler
    # charges a build's rows in one go, not under a lock per row)
    uncharged: list[tuple[str, int]] = field(default_factory=list)

    def chunk_len(self, seq: Seq, budget: int, cost: PrefillCost | None) -> int:
        """Tokens of seq for this step: within the token budget and, for a prompt chunk next
        to decoders, the work budget (charged here, even if its blocks then do not fit)."""
        n = min(seq.num_pending, budget)
        if self.tokens_left is None or n <= 1:
            return n
        if n == seq.num_pending and self._last_chunk(seq.num_computed, n, cost):
            return n
        n = min(n, self.tokens_left)
        if self.work_left is not None and cost is not None and n > 0:
            n = cost.chunk(seq.num_computed, n, self.work_left, self.prompt_chunks == 0)
            self.work_left -= cost.cost(seq.num_computed, n)
            self.prompt_chunks += 1
        self.tokens_left -= n
        return n

    def _last_chunk(self, start: int, n: int, cost: PrefillCost | None) -> bool:
        """Takes a prompt's last n tokens whole if they fit what is left of the single caps,
        or would fit them alone and fit with the burst room; charged to the single caps
        first. Without burst room this is the plain cap (a last chunk that fits is taken
        whole; one that does not is sized by the caller)."""
        assert self.tokens_left is not None  # <= cap_tokens, as work_left <= cap_work
        if n > self.tokens_left + self.burst_tokens or n > self.cap_tokens:
            return False
        over = n > self.tokens_left  # it takes burst room (tokens, or work below)
        if self.work_left is not None and cost is not None:
            work = cost.cost(start, n)
            left = max(self.work_left, 0.0)
            if work > left + self.burst_work or work > self.cap_work:
                return False
            over = over or work > left
            self.burst_work -= max(0.0, work - left)
            self.work_left -= min(work, left)
            self.prompt_chunks += 1
        self.burst_chunks += over
        self.burst_tokens -= max(0, n - self.tokens_left)
        self.tokens_left = max(0, self.tokens_left - n)
        return True

    def sample(self, seconds: float, cost: PrefillCost | None) -> StepSample:
        """What the step cost, for kv/cost.py and sched/step_time.py: decode rows (one token
        of a sequence that has output) vs prompt (or recomputed) tokens and their work."""
        rows, tokens, work = 0, 0, 0.0
        for seq, inp, n in zip(self.seqs, self.inputs, self.counts):
            if n == 1 and seq.output_ids:
                rows += 1
                continue
            tokens += n
            if cost is not None:
                work += cost.cost(inp.num_computed, n)
        return StepSample(tokens, rows, seconds, work)

    def add(self, seq: Seq, n: int, bitmask: torch.Tensor | None) -> None:
        """Appends seq's next n tokens as one row of the batch (it samples when they end its
        pending tokens)."""
        start = seq.num_computed
        self._append(
            seq, start, n, seq.token_slice(start, start + n), start + n == seq.num_tokens, bitmask
        )

    def add_fed(self, seq: Seq, row: int) -> None:
        """Appends seq's next decode row in a step built ahead (sched/ahead.py): one position
        past the step in flight, whose sampled id of `row` the runner feeds it on the device;
        output_token_ids lacks that fed token (the runner counts it)."""
        self._append(seq, seq.num_computed + 1, 1, _PLACEHOLDER, True, None, row)

    def _append(
        self,
        seq: Seq,
        start: int,
        n: int,
        token_ids: Sequence[int],
        sample: bool,
        bitmask: torch.Tensor | None,
        fed_from: int = -1,
    ) -> None:
        assert seq.lease is not None
        table = seq.lease.table()
        self.seqs.append(seq)
        self.counts.append(n)
        self.uncharged.append((seq.tenant, n))
        self.inputs.append(
            SeqInput(
                token_ids=token_ids,
                num_computed=start,
                block_table=table.block_ids,
                seq_id=seq.seq_id,
                table_epoch=table.epoch,
                sample=sample,
                sampling=seq.req.sampling,
                seed=seq.seed,
                # the live list, not a copy per row and step: the runner reads it only while
                # it launches this step, before the writeback appends to it (SeqInput)
                output_token_ids=seq.output_ids,
                token_bitmask=bitmask,
                fed_from=fed_from,
            )
        )
