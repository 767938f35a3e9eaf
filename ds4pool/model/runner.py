"""ModelRunner: owns the paged KV tensors and runs one forward per step over a ragged batch.

The contract with the layer above (scheduler, generate loop) is a list of `SeqInput`s
(ids and counts, no tensors) in, a `StepOutput` out. One host sync per step: the
readback of the sampled ids. `step` = `wait(launch(...))`: `launch` queues the device work
and the readback, `wait` is the sync, so the worker can write back the step before while the
device runs the next one (sched/worker.py, overlap).

A decode step may also be launched *ahead*, before the step it follows has been read back
(`launch(seqs, feed=launched)`): rows with `fed_from >= 0` take their input id from that
step's sampled ids on the device, so the device goes from one step to the next without
waiting for the host (sched/worker.py, overlap "ahead"). At most two steps are in flight;
they are waited in launch order.

Two paths:
- decode-only steps (one token per sequence) go through the persistent `InputBatch`,
  which uploads only what changed (block tables by diffs keyed by seq_id and the table's
  epoch); on CUDA with a graph-capable backend they replay a captured CUDA graph;
- a step of decodes plus one prompt chunk of at most `max_graph_chunk` tokens goes
  through the persistent `MixedBatch` and, with graphs, replays a mixed-step graph;
- with graphs captured ahead (`cuda_graphs="ahead"`, `capture_graphs`), a step whose shape
  has no graph yet runs eagerly and its shape is captured when the worker is idle;
- every other step (several chunks, a long chunk) builds its metadata from the lists and
  runs eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ds4pool.errors import ContextLengthError, DeviceError
from ds4pool.model.attention import AttentionBackend, TorchPagedAttention, build_metadata
from ds4pool.model.attention_mla import MLABackend, TorchMLAAttention
from ds4pool.model.attention_mla_triton import TritonMLAAttention
from ds4pool.model.attention_triton import TritonPagedAttention, triton_available
from ds4pool.model.cuda_graphs import MODES, CaptureReport, StepGraphs, default_buckets
from ds4pool.model.device import host_ints, upload
from ds4pool.model.grammar import apply_token_bitmask
from ds4pool.model.input_batch import DecodeRow, InputBatch
from ds4pool.model.kv_layout import KVLayout
from ds4pool.model.loader import LoadedModel
from ds4pool.model.mixed_batch import ChunkRow, MixedBatch, MixedShape
from ds4pool.model.ops import TorchOps, TritonOps
from ds4pool.model.sampler import GREEDY, Sampler, SamplingParams
from ds4pool.model.warm_up import WarmUpReport, eager_shapes

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqInput:
    """One sequence's share of a step, a value: built for one step and never changed.

    # [0, num_computed)                         already in the KV cache
    # [num_computed, num_computed + len(ids))   computed by this step

    Not frozen: a frozen dataclass sets each field through object.__setattr__, ~3x the
    cost of this one's construction, and the scheduler builds one per row per step.
    """

    token_ids: Sequence[int]
    num_computed: int
    block_table: Sequence[int]
    sample: bool = True  # False for a prompt chunk that is not the prompt's last
    sampling: SamplingParams = GREEDY
    seed: int = 0
    # generated so far: penalties and RNG step. Read only while the step is launched: the
    # caller may append to it once `launch` has returned (the scheduler passes its live list)
    output_token_ids: Sequence[int] = ()
    # Identity for the persistent input batch: the runner re-sends only the block ids past
    # those it holds for (seq_id, table_epoch); None re-sends the whole table every step.
    seq_id: int | None = None
    table_epoch: int = 0
    # host int32 [ceil(V / 32)], bit v set = token v allowed (grammar-constrained rows only)
    token_bitmask: torch.Tensor | None = None
    # >= 0: a decode row whose one input id is row `fed_from` of the sampled ids of the step
    # passed as launch(feed=...), copied on the device (token_ids holds a placeholder); that
    # token is not in output_token_ids yet, so it counts in the sampler's step index. Rows
    # with penalties or a grammar cannot be fed: both need the token on the host.
    fed_from: int = -1

    @property
    def context_len(self) -> int:
        return self.num_computed + len(self.token_ids)


@dataclass(frozen=True)
class StepOutput:
    sampled: list[int | None]  # per SeqInput; None where sample=False
    logits: torch.Tensor | None = None  # [num_sampled, V] float32, when asked for


@dataclass(frozen=True)
class Launched:
    """A step launched and not yet waited: where its sampled ids will be."""

    num_seqs: int
    rows: list[int]  # indices of the SeqInputs that sample
    sampled: torch.Tensor | None  # [R] int64: pinned host (CUDA, valid after the event), or CPU
    event: torch.cuda.Event | None
    logits: torch.Tensor | None
    device_sampled: torch.Tensor | None = None  # [R] int64 on the device: what a step fed reads
    eager: bool = False  # a prompt step run op by op (no CUDA graph for it): the trace says so


BACKENDS = ("auto", "torch", "triton", "triton-split", "triton-small")
# the small tile of "triton-small" (PrefillLaunch.small_m): G=4 heads of up to 4 query tokens
SMALL_TILE_ROWS = 16


def select_backend(
    name: str, device: torch.device, kv_kind: str = "kv"
) -> AttentionBackend | MLABackend:
    """ "auto": Triton on CUDA where triton imports, else the torch reference; for latent
    attention (kv_kind "mla") the same choice between its own two backends. "triton-split":
    Triton with a mixed step's decode rows in the decode kernel (TritonPagedAttention's
    split_decode_rows; opt-in: no end-to-end gain measured, docs/BENCHMARKS.md runs L, T).
    "triton-small": one prefill launch whose decode rows run on 16-row tiles instead of the
    launch's 128 (PrefillLaunch.small_m; opt-in until measured on a GPU)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} ({', '.join(BACKENDS)})")
    triton = name.startswith("triton")
    if triton and (device.type != "cuda" or not triton_available()):  # the CLI: one line
        raise DeviceError(f"the {name} attention backend needs CUDA and the triton package")
    if kv_kind == "mla":
        return TritonMLAAttention() if triton else TorchMLAAttention()
    if triton:
        return TritonPagedAttention(
            split_decode_rows=name == "triton-split",
            small_m=SMALL_TILE_ROWS if name == "triton-small" else 0,
        )
    return TorchPagedAttention()


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int = 16,
        *,
        backend: str = "auto",
        cuda_graphs: bool | str = True,
        max_decode_batch: int = 64,
        max_graph_chunk: int = 512,
        max_graph_chunks: int = 1,
        kv_head_major: bool | None = None,
        attention: AttentionBackend | MLABackend | None = None,
    ) -> None:
        """`cuda_graphs`: "eager" (none), "lazy" (captured on first use; True), "ahead"
        (captured by `capture_graphs`, misses run eagerly and are captured when idle).
        `max_graph_chunk` / `max_graph_chunks`: a mixed step replays a graph with up to that
        many prompt tokens in up to that many chunks (mixed_batch.py).
        `kv_head_major`: the KV memory order (kv_layout.py); None = head-major on CPU only.
        `attention`: a backend instance instead of `backend`'s choice (tests drive the
        Triton backend's launches on CPU this way, tests/unit/test_triton_variants.py)."""
        mode = {True: "lazy", False: "eager"}.get(cuda_graphs, cuda_graphs)  # type: ignore[call-overload]
        if mode not in MODES:
            raise ValueError(f"cuda_graphs must be one of {', '.join(MODES)}, not {mode!r}")
        cfg = loaded.config
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = cfg.max_position
        kv_kind, planes, heads, dim = cfg.kv_cache
        self.backend = attention or select_backend(backend, self.device, kv_kind)
        if kv_head_major and self.backend.name == "triton":
            raise ValueError("the triton attention backend needs the token-major KV order")
        self.layout = KVLayout(
            cfg.num_layers,
            num_blocks,
            block_size,
            heads,
            dim,
            loaded.dtype,
            planes,
            # CPU decode reads one head's keys as a matrix (kv_layout.py); CUDA's Triton
            # kernels want the token-major order
            head_major=self.device.type == "cpu" if kv_head_major is None else kv_head_major,
        )
        self.kv_caches = self.layout.allocate(self.device)
        set_backend = getattr(self.model, "set_attention_backend", None)
        if set_backend is not None:
            # the fused elementwise kernels go with either Triton attention backend
            fused = self.backend.name in ("triton", "triton-mla")
            set_backend(self.backend, TritonOps() if fused else TorchOps())
        self.sampler = Sampler(self.device)
        # pinned [>= R] int64 buffers for the sampled ids (CUDA), two: a step launched ahead
        # reads back into the other one
        self._readback: list[torch.Tensor | None] = [None, None]
        self._flip = 0
        self._launched = 0  # launched steps not waited yet (2 only with a step fed)
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        self.batch = InputBatch(
            self.layout,
            max_decode_batch,
            self.max_blocks_per_seq,
            self.device,
            self.backend.index_dtype,
            cfg.sliding_window,
        )
        self.graphs: StepGraphs | None = None
        self.mixed: MixedBatch | None = None
        # A model may opt out (the scripted test model reads its cache on the host).
        graphable = self.backend.supports_cuda_graphs and getattr(
            self.model, "supports_cuda_graphs", True
        )
        if mode != "eager" and self.device.type == "cuda" and graphable:
            partitions = None
            graph_parts = getattr(self.backend, "graph_prefill_partitions", None)
            if graph_parts is not None and max_graph_chunk > 0:
                self.mixed = MixedBatch(
                    self.layout,
                    max_decode_batch,
                    max(32, max_graph_chunk),
                    self.max_blocks_per_seq,
                    self.device,
                    self.backend.index_dtype,
                    cfg.sliding_window,
                    max_graph_chunks,
                )

                def partitions(chunk: int, width_tokens: int) -> int:
                    return graph_parts(chunk, cfg.num_heads, cfg.num_kv_heads, width_tokens)

            self.graphs = StepGraphs(
                self.model,
                self.kv_caches,
                self.batch,
                default_buckets(max_decode_batch),
                cfg.vocab_size,
                loaded.dtype,
                self.mixed,
                partitions,
                mode,
                getattr(self.backend, "graph_gather_tokens", None),
            )

    @property
    def graph_chunk_sizes(self) -> tuple[int, ...]:
        """Prompt chunk sizes that replay a mixed-step graph unpadded; () without graphs."""
        return tuple(self.graphs.chunks) if self.graphs is not None else ()

    def capture_graphs(self, max_seconds: float) -> CaptureReport | None:
        """Capture every graph a step can need now (ahead mode), for at most max_seconds;
        None when there are no graphs or they are captured lazily."""
        if self.graphs is None or self.graphs.mode != "ahead":
            return None
        with torch.inference_mode():
            return self.graphs.capture_ahead(max_seconds)

    def capture_pending_graph(self) -> bool:
        """Capture one graph left for idle time; True while more remain."""
        if self.graphs is None or self.graphs.mode != "ahead":
            return False
        with torch.inference_mode():
            return self.graphs.capture_pending()

    def warm_up_eager(self, max_chunk: int, max_seconds: float) -> WarmUpReport:
        """Run the eager steps of `warm_up.eager_shapes` (prompt chunks of up to `max_chunk`
        tokens, contexts up to what the model and the KV pool hold) over the scratch block
        only, for at most max_seconds: what a step that runs without a CUDA graph compiles
        (Triton) or picks (cuBLAS) is done before serving. An optimisation, never a reason
        not to serve: a step that fails (out of memory: a backend whose prompt attention
        materialises scores, as the latent one's torch reference does at long contexts)
        ends the warm-up with a warning, and serving starts with the rest left out."""
        t0 = time.perf_counter()
        max_len = min(self.max_model_len, self.num_blocks * self.block_size)
        shapes = eager_shapes(max_len, max_chunk, self.batch.max_rows)
        scratch = self.layout.num_blocks  # block id of the scratch block
        bs, done = self.block_size, 0
        for shape in shapes:
            if time.perf_counter() - t0 > max_seconds:
                break
            table = [scratch] * -(-(shape.context + shape.chunk) // bs)
            rows = [SeqInput([0], shape.context, table) for _ in range(shape.decode_rows)]
            chunk = SeqInput([0] * shape.chunk, shape.context, table)
            try:
                self.wait(self.launch([*rows, chunk], eager=True))
            except Exception as exc:  # logged: serving goes on without the rest
                self._launched = 0
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                log.warning("eager warm-up stopped at %s: %s", shape, str(exc)[:200])
                break
            done += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        report = WarmUpReport(done, time.perf_counter() - t0, len(shapes) - done)
        log.info(
            "ran %d eager warm-up steps in %.1f s (kernel variants of steps without a graph); "
            "%d left out",
            report.steps,
            report.seconds,
            report.left,
        )
        return report

    @staticmethod
    def blocks_for_bytes(loaded: LoadedModel, block_size: int, nbytes: int) -> int:
        per_token = loaded.config.kv_bytes_per_token(loaded.dtype.itemsize)
        # one block more is allocated as scratch (KVLayout)
        return max(1, nbytes // (per_token * block_size) - 1)

    @property
    def kv_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def scratch_step(self, rows: int = 4, chunk: int = 32, context: int = 512) -> list[SeqInput]:
        """A step for timing only (the start-up thread probe): `rows` decode rows at `context`
        tokens and a `chunk`-token prompt chunk after as many, each on its own blocks from
        the first ones of the cache, shrunk to fit the cache and the model's length. Run it
        before anything holds blocks: it writes the KV of the blocks it uses."""
        bs, vocab = self.block_size, self.loaded.config.vocab_size
        chunk = max(1, min(chunk, self.max_model_len // 2))
        context = max(1, min(context, self.max_model_len - chunk))

        def fits() -> bool:
            return -(-(context + chunk) // bs) * (rows + 1) <= self.num_blocks

        while context > 1 and not fits():
            context //= 2
        while rows and not fits():
            rows -= 1
        while chunk > 1 and not fits():
            chunk //= 2
        per = -(-(context + chunk) // bs)
        tables = [list(range(i * per, (i + 1) * per)) for i in range(rows + 1)]
        seqs = [SeqInput([1 % vocab], context - 1, tables[i]) for i in range(rows)]
        ids = [(7 + i) % vocab for i in range(chunk)]
        return [*seqs, SeqInput(ids, context, tables[rows])]

    def validate(self, seqs: Sequence[SeqInput]) -> None:
        """Host-side checks a bad batch would otherwise turn into a device fault."""
        vocab = self.loaded.config.vocab_size
        bs, max_len = self.block_size, self.max_model_len
        for s in seqs:
            ids = s.token_ids
            if not ids:
                raise ValueError("a sequence in the batch has no tokens to compute")
            context_len = s.num_computed + len(ids)
            if context_len > max_len:
                raise ContextLengthError(
                    f"context of {context_len} tokens exceeds the model's {max_len}"
                )
            if context_len > len(s.block_table) * bs:
                raise ValueError(
                    f"block table holds {len(s.block_table) * bs} tokens, step needs {context_len}"
                )
            # a decode row's one id without min() and max() over a list (every row, every step)
            if not (0 <= ids[0] < vocab if len(ids) == 1 else 0 <= min(ids) and max(ids) < vocab):
                raise ValueError(f"token id outside the vocabulary [0, {vocab})")

    def step(self, seqs: Sequence[SeqInput], return_logits: bool = False) -> StepOutput:
        return self.wait(self.launch(seqs, return_logits))

    @torch.inference_mode()
    def launch(
        self,
        seqs: Sequence[SeqInput],
        return_logits: bool = False,
        feed: Launched | None = None,
        eager: bool = False,
    ) -> Launched:
        """All of a step's device work up to the sampled ids and their copy to the host,
        without waiting for it (on CUDA the host returns while the device runs; on CPU the
        work is done here). A launch must be waited before the next one, unless the next is
        a decode step fed by it (`feed`, rows with `fed_from`): then two are in flight, and
        the first must not have asked for logits (a graph's output buffer is reused).
        `eager`: a step with prompt chunks runs eagerly even where a mixed-step graph has
        its shape (warm_up_eager)."""
        fed = [i for i, s in enumerate(seqs) if s.fed_from >= 0]
        if feed is None:
            assert not self._launched, "launch() before the previous step was waited"
            assert not fed, "rows with fed_from need the step that feeds them (feed=)"
        else:
            assert self._launched <= 1, "launch() with two steps not waited"
            assert feed.logits is None and feed.device_sampled is not None, "feed has no ids"
        self.validate(seqs)
        rows = [i for i, s in enumerate(seqs) if s.sample]
        decode = self._is_decode(seqs)
        assert decode or not fed, "only a decode step can be fed"
        ran_eagerly = False
        if decode:
            logits = self._decode_logits(seqs, fed, feed)  # [B, V], every row
            if len(rows) != len(seqs):  # after the forward's kernels: a pinned upload
                index = upload(host_ints(rows), self.device)
                logits = logits.index_select(0, index)
        elif not eager and (shape := self._mixed_shape(seqs)) is not None:
            logits = self._mixed_logits(seqs, rows, shape)
        else:
            logits = self._eager_logits(seqs, rows)
            ran_eagerly = True
        if not rows:  # nothing to wait for
            return Launched(len(seqs), rows, None, None, None, eager=ran_eagerly)
        logits = logits.float()  # [R, V]
        masked = [(j, m) for j, i in enumerate(rows) if (m := seqs[i].token_bitmask) is not None]
        if masked:  # out of place: logits may be a CUDA graph's static output buffer
            logits = apply_token_bitmask(logits, [j for j, _ in masked], [m for _, m in masked])
        sampled_t = self.sampler.sample(
            logits,
            [seqs[i].sampling for i in rows],
            [seqs[i].seed for i in rows],
            [seqs[i].output_token_ids for i in rows],
            [int(seqs[i].fed_from >= 0) for i in rows] if fed else None,
        )
        on_device, event = sampled_t, None
        if self.device.type == "cuda":  # queue the readback now; wait() only syncs on it
            buf = self._readback[self._flip]
            if buf is None or buf.numel() < len(rows):
                buf = torch.empty(max(len(rows), 64), dtype=torch.int64, pin_memory=True)
                self._readback[self._flip] = buf
            self._flip ^= 1
            host = buf[: len(rows)]
            host.copy_(sampled_t, non_blocking=True)
            sampled_t = host
            event = torch.cuda.Event()
            event.record()
        self._launched += 1
        logits_out = logits if return_logits else None
        return Launched(len(seqs), rows, sampled_t, event, logits_out, on_device, ran_eagerly)

    def wait(self, launched: Launched) -> StepOutput:
        """The one host sync of a step: its sampled ids (steps are waited in launch order)."""
        if launched.sampled is not None:  # a launch with no sampling row queued nothing
            self._launched -= 1
        if launched.event is not None:
            launched.event.synchronize()
        out: list[int | None] = [None] * launched.num_seqs
        if launched.sampled is not None:
            for i, tok in zip(launched.rows, launched.sampled.tolist()):
                out[i] = tok
        return StepOutput(sampled=out, logits=launched.logits)

    def _decode_logits(
        self, seqs: Sequence[SeqInput], fed: Sequence[int] = (), feed: Launched | None = None
    ) -> torch.Tensor:
        n = len(seqs)
        bucket = self.graphs.bucket_for(n) if self.graphs is not None else None
        max_ctx = self.batch.load(
            [
                DecodeRow(s.token_ids[0], s.num_computed, s.block_table, s.seq_id, s.table_epoch)
                for s in seqs
            ],
            bucket or n,
        )
        if fed:  # after the load's upload, in stream order: the fed ids overwrite placeholders
            assert feed is not None and feed.device_sampled is not None
            self.batch.feed(list(fed), [seqs[i].fed_from for i in fed], feed.device_sampled)
        if bucket is not None:
            assert self.graphs is not None
            if self.graphs.ready(self.graphs.decode_key(bucket, max_ctx)):
                return self.graphs.replay(bucket, max_ctx)[:n]
        meta = self.batch.metadata(n, max_ctx)
        hidden = self.model(self.batch.input_ids[:n], self.kv_caches, meta)  # [B, E]
        return self.model.compute_logits(hidden)

    def launches_eagerly(self, seqs: Sequence[SeqInput]) -> bool:
        """Whether launch(seqs) runs a prompt step's forward op by op (no CUDA graph for its
        shape): a launch that holds the host for the whole dispatch, ~10-20 ms of an 8B model
        on an H100 (more where the forward runs on the host, as on CPU). Decode steps: False
        (graphs, or the same eager cost whatever comes first). The same choice as launch's."""
        return not self._is_decode(seqs) and self._mixed_shape(seqs) is None

    def _is_decode(self, seqs: Sequence[SeqInput]) -> bool:
        """One token a row, within the persistent decode batch: launch's decode path."""
        return len(seqs) <= self.batch.max_rows and all(len(s.token_ids) == 1 for s in seqs)

    def _mixed_shape(self, seqs: Sequence[SeqInput]) -> MixedShape | None:
        """The graph shape of a step of decodes plus prompt chunks, if it has one."""
        if self.graphs is None:
            return None
        chunks = [len(s.token_ids) for s in seqs if len(s.token_ids) > 1]
        if not chunks:
            return None
        shape = self.graphs.mixed_shape(len(seqs) - len(chunks), sum(chunks), len(chunks))
        if shape is None:
            return None
        max_ctx = max(s.context_len for s in seqs)
        return shape if self.graphs.ready(self.graphs.mixed_key(shape, max_ctx)) else None

    def _mixed_logits(
        self, seqs: Sequence[SeqInput], rows: list[int], shape: MixedShape
    ) -> torch.Tensor:
        assert self.graphs is not None and self.mixed is not None
        decodes: list[DecodeRow] = []
        chunks: list[ChunkRow] = []
        index: list[int] = []  # seq i → its row in `sampled`'s numbering (decodes, then chunks)
        for s in seqs:
            table, sid, epoch = s.block_table, s.seq_id, s.table_epoch
            if len(s.token_ids) == 1:
                index.append(len(decodes))
                decodes.append(DecodeRow(s.token_ids[0], s.num_computed, table, sid, epoch))
            else:
                index.append(-1 - len(chunks))
                chunks.append(ChunkRow(s.token_ids, s.num_computed, table, sid, epoch))
        b = len(decodes)
        sampled = [index[i] if index[i] >= 0 else b - 1 - index[i] for i in rows]
        max_ctx = self.mixed.load(decodes, chunks, sampled, shape)
        return self.graphs.replay_mixed(shape, max_ctx)[: len(rows)]  # [R, V], rows' order

    def _eager_logits(self, seqs: Sequence[SeqInput], rows: list[int]) -> torch.Tensor:
        meta = build_metadata(
            [len(s.token_ids) for s in seqs],
            [s.context_len for s in seqs],
            [list(s.block_table) for s in seqs],
            self.block_size,
            self.device,
            self.loaded.config.sliding_window,
            self.backend.index_dtype,
        )
        flat = [t for s in seqs for t in s.token_ids]
        ids = upload(host_ints(flat), self.device)
        ends, total = [], 0
        for s in seqs:
            total += len(s.token_ids)
            ends.append(total - 1)
        # uploaded before the forward's kernels are queued, or through pinned memory: a
        # pageable copy after them would hold this launch until the device ran them all
        last = upload(host_ints([ends[i] for i in rows]), self.device)
        hidden = self.model(ids, self.kv_caches, meta)  # [T, E]
        return self.model.compute_logits(hidden[last])  # [R, V]
