"""Batched token sampling: per-row parameters, no host sync, batch-invariant seeded draws.

B = rows in the batch, S = rows that sample (not greedy), V = vocabulary size.

Pipeline per row (vLLM's order): presence/frequency penalties on the tokens generated
so far → greedy rows take the argmax here → temperature → top-k → top-p → min-p →
one draw. Every step works on whole [rows, V] tensors with per-row parameter tensors;
python only decides which stages run at all (from the params, never from tensor values).

Random numbers — a counter-based hash, not a torch.Generator. A shared generator would
make a request's tokens depend on which other requests shared its batches. Instead each
(seed, step, token id) triple is hashed to its own 32-bit integer:

    s    = mix32(mix32(seed_lo ^ SEED_SALT) ^ seed_hi)     seed taken mod 2**64
    key  = mix32(s ^ step)                                 step = len(output_token_ids)
    h[v] = mix32(key ^ mix32(v ^ VOCAB_SALT))
    u[v] = (h[v] + 0.5) / 2**32                            in (0, 1), never 0 or 1

mix32 is hash-prospector's [16 21f0aaad 15 735a2d97 15] (xor-shift-multiply, a bijection
on 32 bits), the finaliser of the common "splitmix32". Two steps' keys differ by some XOR
constant d, so token v at one step shares its noise with token w at the other only when
mix32(w ^ VOCAB_SALT) == mix32(v ^ VOCAB_SALT) ^ d: about V**2 / 2**32 pairs (~5 for a
152k vocabulary), so the streams are independent for all practical purposes. Keys are
computed in python ints; the per-token round runs on device in int64 tensors holding
values in [0, 2**32) with both multipliers < 2**31, so products stay below 2**63 (no
signed overflow) and the integers are bit-identical on CPU and CUDA.

The draw is Gumbel-max in float64: token = argmax(z[v] - log(-log u[v])), which samples
softmax(z) exactly and needs no normalisation. Top-p's probability mass is also summed in
float64. The integer stream is exact; float64 rounding differences between devices or
kernels (and, on CUDA, between reduction layouts chosen for different batch shapes) can
only flip a draw whose two best scores, or a top-p boundary, agree to ~1e-15: in
practice never. MPS has no float64: there the draw uses u = ((h >> 9) + 0.5) / 2**23 and
float32 throughout, the same stream at lower resolution, so a seed's tokens can differ
from CPU/CUDA in near-ties (~1e-6 of draws).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from ds4pool.model.device import upload

_MASK32 = 0xFFFF_FFFF
# mix32's multipliers; both < 2**31 so that x * C < 2**63 for any 32-bit x.
_C1 = 0x21F0AAAD
_C2 = 0x735A2D97
_SEED_SALT = 0x9E3779B9
_VOCAB_SALT = 0xC2B2AE35
# Below this temperature logits / T overflows float32 for ordinary logits; vLLM also
# treats it as greedy.
_GREEDY_EPS = 1e-5
# Logits per chunk of sampled rows. On CPU the ~15 passes over the int64/float64 [rows, V]
# temporaries run ~3x faster when a chunk (2 MiB of int64) stays in the L2/L3 caches (16
# rows of a 128k vocabulary: 103 → 37 ms per step on one EPYC core); a GPU wants few, large
# launches. Chunking is by whole rows, so it never changes a token.
CPU_CHUNK_ELEMENTS = 1 << 18
GPU_CHUNK_ELEMENTS = 1 << 23


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_number(
    name: str, value: object, low: float, high: float, *, low_open: bool = False
) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        if (low < value if low_open else low <= value) and value <= high:
            return
    left = "(" if low_open else "["
    bounds = f">= {low:g}" if high == math.inf else f"in {left}{low:g}, {high:g}]"
    raise ValueError(f"{name} must be a finite number {bounds}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings, validated on construction (ValueError names the field).

    Penalties follow OpenAI's semantics and vLLM's convention: they count only the tokens
    generated so far, not the prompt.
    """

    temperature: float = 1.0  # < 1e-5 (normally 0) → greedy
    top_p: float = 1.0  # (0, 1]; 1 disables
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0  # [0, 1]; 0 disables
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    seed: int | None = None  # None: the caller draws one per request

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, 0.0, math.inf)
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= -1 (0/-1: off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


GREEDY = SamplingParams(temperature=0.0)


def _mix32_int(x: int) -> int:
    """mix32 on a python int in [0, 2**32)."""
    x ^= x >> 16
    x = (x * _C1) & _MASK32
    x ^= x >> 15
    x = (x * _C2) & _MASK32
    x ^= x >> 15
    return x


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """mix32 in place on an int64 tensor of values in [0, 2**32); equals _mix32_int."""
    x ^= x >> 16
    x.mul_(_C1).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(_C2).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def _row_key(seed: int, step: int) -> int:
    """The 32-bit key of one (seed, step); see the module docstring."""
    s = _mix32_int((seed & _MASK32) ^ _SEED_SALT)
    s = _mix32_int(s ^ ((seed >> 32) & _MASK32))
    return _mix32_int(s ^ (step & _MASK32))


class Sampler:
    """Turns logits [B, V] into one token id per row, each row with its own SamplingParams.

    Invariants:
    - A row's token depends only on its logits, params, seed and step (the length of its
      output_token_ids): never on the batch size, its position or the other rows.
    - Every row keeps at least one candidate, so every row yields a token.
    - No host sync: per-row parameters go host → device (pinned, non-blocking on CUDA);
      the caller does the one readback of the returned ids.
    - The caller's logits are never modified.
    Memory: sampled rows are processed in chunks of about `chunk_elements` logits (default
    CPU_CHUNK_ELEMENTS on CPU, GPU_CHUNK_ELEMENTS elsewhere), which
    bounds the float64/int64 temporaries to a few times 8 * chunk_elements bytes; on top of
    that come a few float32 [B, V] tensors (the float copy of the logits, penalties).
    """

    def __init__(self, device: torch.device | str, *, chunk_elements: int | None = None) -> None:
        self.device = torch.device(device)
        if chunk_elements is None:
            cpu = self.device.type == "cpu"
            chunk_elements = CPU_CHUNK_ELEMENTS if cpu else GPU_CHUNK_ELEMENTS
        assert chunk_elements >= 1
        self.chunk_elements = chunk_elements
        # Precision of the draw and the top-p mass; MPS has no float64.
        self.float_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self._vocab_hash: torch.Tensor | None = None  # [V] int64, mix32(v ^ _VOCAB_SALT)
        # CUDA: greedy rows' argmax in one many-program launch (kernels/triton_argmax.py;
        # torch.argmax's result exactly); made on the first eager call, before any capture
        self._argmax_ws: object | None = None

    def _argmax(self, logits32: torch.Tensor) -> torch.Tensor:
        """argmax along V of [B, V]: torch's, or on CUDA the Triton kernel (same ids)."""
        if logits32.is_cuda and logits32.stride(-1) == 1 and logits32.shape[-1] > 0:
            from ds4pool.model.kernels import triton_argmax

            if self._argmax_ws is None and not torch.cuda.is_current_stream_capturing():
                self._argmax_ws = triton_argmax.ArgmaxWorkspace(logits32.device)
            ws = self._argmax_ws
            if isinstance(ws, triton_argmax.ArgmaxWorkspace) and len(logits32) <= len(ws.counters):
                return triton_argmax.argmax_rows(logits32, ws)
        return logits32.argmax(dim=-1)

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        output_token_ids: Sequence[Sequence[int]],
        unseen: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """logits [B, V] (any float dtype, on device) → sampled ids [B] int64 on the same device.

        seeds[i] is row i's resolved seed; output_token_ids[i] the tokens it generated so far
        (penalties count them; their number is the step index of the random stream).
        unseen[i]: tokens row i has generated that are not in output_token_ids[i] yet (a step
        launched ahead of its predecessor's readback: runner.SeqInput.fed_from); they count
        in the step index. Rows with penalties must have none (the caller's rule).
        """
        num_rows, vocab_size = logits.shape
        assert len(params) == len(seeds) == len(output_token_ids) == num_rows
        assert logits.device.type == self.device.type, (logits.device, self.device)
        logits32 = self._penalized(logits.float(), params, output_token_ids)  # [B, V]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        steps = [len(ids) for ids in output_token_ids]
        if unseen is not None:
            steps = [s + u for s, u in zip(steps, unseen, strict=True)]
        if len(rows) == num_rows:
            return self._sample_rows(logits32, params, seeds, steps)
        token_ids = self._argmax(logits32)  # [B]; first index on ties
        if not rows:
            return token_ids
        row_index = self._upload(torch.tensor(rows), logits.device)  # [S]
        sampled = self._sample_rows(
            logits32.index_select(0, row_index),  # [S, V]
            [params[i] for i in rows],
            [seeds[i] for i in rows],
            [steps[i] for i in rows],
        )
        return token_ids.index_copy(0, row_index, sampled)

    def _penalized(
        self,
        logits32: torch.Tensor,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[Sequence[int]],
    ) -> torch.Tensor:
        """logits32 - presence * (count > 0) - frequency * count, out of place.  # [B, V]"""
        rows = [
            i
            for i, p in enumerate(params)
            if (p.presence_penalty or p.frequency_penalty) and output_token_ids[i]
        ]
        if not rows:
            return logits32
        device = logits32.device
        # Flattened token ids plus per-row lengths instead of a padded [P, L] matrix: no
        # dummy entries. Host work is O(tokens generated so far) per step; array() is ~3x
        # faster than torch.tensor() on a long list of ints.
        lengths = [len(output_token_ids[i]) for i in rows]
        flat = array("q", chain.from_iterable(output_token_ids[i] for i in rows))
        token_ids = self._upload(torch.frombuffer(flat, dtype=torch.int64), device)  # [N]
        # output_size spares repeat_interleave a device → host read of the total.
        owner = torch.repeat_interleave(
            torch.arange(len(rows), device=device),
            self._upload(torch.tensor(lengths), device),
            output_size=len(flat),
        )  # [N] row (in rows) of each token
        coefs = self._upload(
            torch.tensor(
                [[params[i].presence_penalty, params[i].frequency_penalty] for i in rows],
                dtype=torch.float32,
            ),
            device,
        )  # [P, 2]
        counts = torch.zeros(len(rows), logits32.shape[1], dtype=torch.float32, device=device)
        # Accumulating 1.0s is exact in float32, so the atomic order on CUDA does not matter.
        ones = torch.ones(len(flat), dtype=torch.float32, device=device)  # [N]
        counts.index_put_((owner, token_ids), ones, accumulate=True)  # [P, V]
        penalty = counts * coefs[:, 1:2] + (counts > 0).float() * coefs[:, 0:1]  # [P, V]
        row_index = self._upload(torch.tensor(rows), device)  # [P]
        return logits32.index_add(0, row_index, penalty, alpha=-1.0)  # [B, V]

    def _sample_rows(
        self,
        logits32: torch.Tensor,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
    ) -> torch.Tensor:
        """Samples every row of logits32 [S, V] → [S], in chunks of rows to bound memory."""
        num_rows, vocab_size = logits32.shape
        device = logits32.device
        top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        floats = self._upload(
            torch.tensor(
                [
                    [p.temperature, p.top_p, math.log(p.min_p) if p.min_p > 0 else -math.inf]
                    for p in params
                ],
                dtype=self.float_dtype,
            ),
            device,
        )  # [S, 3]: temperature, top_p, log(min_p)
        ints = self._upload(
            torch.tensor(
                [[_row_key(s, t), k] for s, t, k in zip(seeds, steps, top_ks, strict=True)],
                dtype=torch.int64,
            ),
            device,
        )  # [S, 2]: hash key, effective top_k in [1, V]
        chunk = max(1, self.chunk_elements // vocab_size)
        sampled = [
            self._sample_chunk(
                logits32[r : r + chunk],
                params[r : r + chunk],
                top_ks[r : r + chunk],
                floats[r : r + chunk],
                ints[r : r + chunk],
            )
            for r in range(0, num_rows, chunk)
        ]  # each [rows in chunk]
        return sampled[0] if len(sampled) == 1 else torch.cat(sampled)

    def _sample_chunk(
        self,
        logits32: torch.Tensor,
        params: Sequence[SamplingParams],
        top_ks: Sequence[int],
        floats: torch.Tensor,
        ints: torch.Tensor,
    ) -> torch.Tensor:
        """One chunk of _sample_rows: the stages after penalties, then the draw.  # [S]"""
        vocab_size = logits32.shape[1]
        z = logits32 / floats[:, 0:1].float()  # [S, V] temperature-scaled logits
        use_top_p = any(p.top_p < 1.0 for p in params)
        if use_top_p or min(top_ks) < vocab_size:
            # Only the best max(top_k) values can matter when every row has a top-k.
            prefix = max(top_ks) if all(p.top_k > 0 for p in params) else vocab_size
            _mask_top_k_top_p(z, ints[:, 1], floats[:, 1] if use_top_p else None, prefix)
        if any(p.min_p > 0.0 for p in params):
            # p[v] >= min_p * p_max  <=>  z[v] >= z_max + log(min_p); the max is always kept.
            floor = z.amax(dim=-1, keepdim=True) + floats[:, 2:3].float()  # [S, 1]
            z.masked_fill_(z < floor, -math.inf)
        return self._gumbel_argmax(z, ints[:, 0])

    def _gumbel_argmax(self, z: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """argmax(z - log(-log u)) with u from the hash stream: a draw from softmax(z).  # [S]"""
        x = key[:, None] ^ self._vocab_keys(z.shape[1], z.device)[None, :]  # [S, V] int64
        _mix32_(x)
        # [S, V] uniforms in (0, 1), exact in the float type, so log(-log u) is finite.
        if self.float_dtype == torch.float64:
            u = x.double().add_(0.5).mul_(2.0**-32)
        else:
            u = (x >> 9).float().add_(0.5).mul_(2.0**-23)  # 23 bits + 0.5 fit float32 exactly
        del x
        neg_gumbel = u.log_().neg_().log_()  # [S, V] = log(-log u)
        # z (float32) is promoted exactly; out= reuses the noise buffer.
        return torch.sub(z, neg_gumbel, out=neg_gumbel).argmax(dim=-1)  # [S]

    def _vocab_keys(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """mix32(v ^ _VOCAB_SALT) for v in [0, V), cached per vocabulary size.  # [V]"""
        cached = self._vocab_hash
        if cached is None or cached.shape[0] != vocab_size or cached.device != device:
            v = torch.arange(vocab_size, dtype=torch.int64, device=device)
            cached = self._vocab_hash = _mix32_(v ^ _VOCAB_SALT)
        return cached

    def _upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Host tensor → device without a host sync (model/device.py upload)."""
        return upload(host, device)


def _mask_top_k_top_p(
    z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, prefix: int
) -> None:
    """Sets z [S, V] to -inf outside each row's top-k, then outside its top-p nucleus.

    top_k [S] int64 in [1, prefix] (V = disabled); top_p [S] in (0, 1] or None (all 1), whose
    float dtype the mass is summed in; prefix <= V is how many of the largest values to sort,
    >= every top_k.
    The nucleus is the shortest prefix of the sorted top-k distribution whose mass reaches
    top_p: a token is kept while the mass strictly before it is < top_p, so the first always
    is. The cut is applied as a value threshold, so tokens tied with the last kept one stay
    and the result depends on the values alone, not on how sort or topk order ties.
    """
    if prefix < z.shape[1]:
        sorted_z = z.topk(prefix, dim=-1).values  # [S, prefix] descending
    else:
        sorted_z = z.sort(dim=-1, descending=True).values  # [S, V]
    positions = torch.arange(prefix, device=z.device)  # [prefix]
    sorted_z.masked_fill_(positions[None, :] >= top_k[:, None], -math.inf)
    num_keep = top_k  # [S] length of the kept sorted prefix, >= 1
    if top_p is not None:
        # Values past `prefix` are below every row's top-k cut, so they add exactly 0 here.
        probs = torch.softmax(sorted_z.to(top_p.dtype), dim=-1)  # [S, prefix], descending
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [S, prefix]; column 0 is 0
        in_nucleus = (mass_before < top_p[:, None]).sum(dim=-1)  # [S] >= 1
        # top_p == 1 keeps all of top-k even if the float64 mass sums to just under 1.
        num_keep = torch.where(top_p >= 1.0, top_k, torch.minimum(in_nucleus, top_k))
    threshold = sorted_z.gather(1, (num_keep - 1)[:, None])  # [S, 1] smallest kept value
    z.masked_fill_(z < threshold, -math.inf)
