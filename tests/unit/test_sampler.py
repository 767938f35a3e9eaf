"""Sampler behaviour a user would notice: greedy, filters, distributions, seeds, penalties."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from ds4pool.model import sampler as sampler_mod
from ds4pool.model.sampler import GREEDY, Sampler, SamplingParams

CPU = torch.device("cpu")


def _logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale  # [rows, V]


# Batch-mates whose params switch the sampler's optional stages (sort, top-p, min-p) on or off.
MATES = [
    None,
    SamplingParams(),
    SamplingParams(top_k=2),
    SamplingParams(top_p=0.5),
    SamplingParams(min_p=0.3, temperature=0.5),
]


def _draws(
    row: torch.Tensor,
    params: SamplingParams,
    n: int,
    mate: SamplingParams | None = None,
    sampler: Sampler | None = None,
) -> torch.Tensor:
    """n draws from one logits row [V]: n different (seed, step) pairs in one batch, with a
    `mate` row between every two when given.  # [n]"""
    sampler = sampler or Sampler(CPU)
    seeds = [i // 10 for i in range(n)]
    outputs = [[0] * (i % 10) for i in range(n)]  # only their lengths (the steps) matter here
    if mate is None:
        return sampler.sample(row.expand(n, -1), [params] * n, seeds, outputs)
    mixed = sampler.sample(
        row.expand(2 * n, -1),
        [params, mate] * n,
        [s for s in seeds for _ in "ab"],
        [o for o in outputs for _ in "ab"],
    )
    return mixed[0::2]


def _probs(row: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(row.double() / temperature, dim=-1)  # [V]


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    """Shortest most-probable set whose mass reaches top_p, computed the slow way."""
    kept: set[int] = set()
    mass = 0.0
    for v in probs.argsort(descending=True).tolist():
        if mass >= top_p:
            break
        kept.add(v)
        mass += probs[v].item()
    return kept


def _generate(
    sampler: Sampler,
    step_logits: Sequence[torch.Tensor],
    params: SamplingParams,
    seed: int,
    batch_sizes: Sequence[int] = (1,),
) -> list[int]:
    """Runs one seeded request for len(step_logits) steps; at step t it shares a batch of
    batch_sizes[t % len] rows with unrelated requests, at position t % B."""
    others = [
        GREEDY,
        SamplingParams(temperature=1.5),
        SamplingParams(top_k=3, temperature=0.7),
        SamplingParams(top_p=0.5, min_p=0.2, frequency_penalty=1.0),
        SamplingParams(presence_penalty=-1.0, top_k=100, top_p=0.95),
    ]
    out: list[int] = []
    for step, row in enumerate(step_logits):
        num_rows = batch_sizes[step % len(batch_sizes)]
        pos = step % num_rows
        logits = _logits(num_rows, row.shape[0], seed=1000 + step)  # [B, V]
        logits[pos] = row
        params_b = [others[(i + step) % len(others)] for i in range(num_rows)]
        params_b[pos] = params
        seeds = [7 * i + step for i in range(num_rows)]
        seeds[pos] = seed
        outputs = [[(i * 13 + j) % row.shape[0] for j in range(i + step)] for i in range(num_rows)]
        outputs[pos] = out
        out = out + [int(sampler.sample(logits, params_b, seeds, outputs)[pos])]
    return out


def test_greedy_is_argmax_alone_and_in_mixed_batch() -> None:
    logits = _logits(16, 1000, seed=0)
    expected = logits.argmax(dim=-1)
    sampler = Sampler(CPU)
    assert torch.equal(sampler.sample(logits, [GREEDY] * 16, list(range(16)), [[]] * 16), expected)
    mixed = [GREEDY if i % 2 else SamplingParams(seed=i) for i in range(16)]
    got = sampler.sample(logits, mixed, list(range(16)), [[]] * 16)
    assert got.dtype == torch.int64 and got.shape == (16,)
    assert torch.equal(got[1::2], expected[1::2])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1, temperature=2.0),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
    ],
)
def test_filters_that_keep_one_token_act_like_greedy(params: SamplingParams) -> None:
    logits = _logits(32, 500, seed=1)
    got = Sampler(CPU).sample(logits, [params] * 32, list(range(32)), [[1, 2]] * 32)
    assert torch.equal(got, logits.argmax(dim=-1))


@pytest.mark.parametrize("mate", MATES)
def test_sampled_tokens_stay_in_top_k(mate: SamplingParams | None) -> None:
    row = _logits(1, 40, seed=2)[0]
    draws = set(_draws(row, SamplingParams(top_k=5, temperature=1.3), 4000, mate).tolist())
    assert draws == set(row.topk(5).indices.tolist())


@pytest.mark.parametrize("mate", MATES)
def test_sampled_tokens_stay_in_top_p_nucleus(mate: SamplingParams | None) -> None:
    row = _logits(1, 40, seed=3)[0]
    allowed = _nucleus(_probs(row, 1.3), 0.7)
    draws = set(_draws(row, SamplingParams(top_p=0.7, temperature=1.3), 4000, mate).tolist())
    assert draws <= allowed and len(draws) >= 2


@pytest.mark.parametrize("mate", MATES)
def test_sampled_tokens_stay_above_min_p(mate: SamplingParams | None) -> None:
    row = _logits(1, 40, seed=4)[0]
    probs = _probs(row, 1.3)
    allowed = set(torch.nonzero(probs >= 0.1 * probs.max()).flatten().tolist())
    draws = set(_draws(row, SamplingParams(min_p=0.1, temperature=1.3), 4000, mate).tolist())
    assert draws == allowed


def _chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    n = draws.numel()
    counts = torch.bincount(draws, minlength=probs.numel()).double()  # [V]
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the support was sampled"
    expected = probs[support] * n
    return float(((counts[support] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_frequencies_match_softmax_at_temperature(temperature: float) -> None:
    row = _logits(1, 8, seed=5, scale=1.5)[0]
    probs = _probs(row, temperature)
    draws = _draws(row, SamplingParams(temperature=temperature), 20_000)
    # chi-square, 7 degrees of freedom: P(> 30) ≈ 1e-4 for a correct sampler.
    assert _chi_square(draws, probs) < 30.0
    freqs = torch.bincount(draws, minlength=8).double() / draws.numel()
    assert (freqs - probs).abs().max() < 0.015


def test_frequencies_after_top_k_and_top_p_are_renormalised() -> None:
    row = _logits(1, 12, seed=6, scale=1.0)[0]
    probs = _probs(row, 0.8)
    top6 = row.topk(6).indices
    in_k = torch.zeros(12, dtype=torch.double).index_fill_(0, top6, 1.0) * probs
    nucleus = _nucleus(in_k / in_k.sum(), 0.8)
    expected = torch.zeros(12, dtype=torch.double)
    expected[list(nucleus)] = probs[list(nucleus)]
    expected /= expected.sum()
    draws = _draws(row, SamplingParams(temperature=0.8, top_k=6, top_p=0.8), 20_000)
    assert _chi_square(draws, expected) < 3 * len(nucleus) + 15


def test_float32_noise_path_for_mps_samples_the_same_stream() -> None:
    """MPS has no float64; its float32 path must still sample softmax(z) and mostly agree
    with the float64 draws of the same seeds (it reads the top 23 bits of the same hash)."""
    row = _logits(1, 8, seed=10, scale=1.5)[0]
    narrow = Sampler(CPU)
    narrow.float_dtype = torch.float32
    params = SamplingParams(temperature=0.8, top_p=0.9)
    draws32 = _draws(row, params, 20_000, sampler=narrow)
    draws64 = _draws(row, params, 20_000)
    assert (draws32 == draws64).double().mean() > 0.999
    probs = _probs(row, 0.8)
    nucleus = list(_nucleus(probs, 0.9))
    expected = torch.zeros(8, dtype=torch.double)
    expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
    assert _chi_square(draws32, expected) < 30.0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            top_k=50,
            min_p=0.02,
            presence_penalty=0.5,
            frequency_penalty=0.3,
        ),
        SamplingParams(temperature=1.0),  # no sort when alone; batch-mates force one
        SamplingParams(temperature=0.7, top_k=20),
    ],
)
def test_seeded_request_is_reproducible_alone_or_batched(params: SamplingParams) -> None:
    steps = [_logits(1, 3000, seed=100 + t, scale=3.0)[0] for t in range(20)]
    alone = _generate(Sampler(CPU), steps, params, seed=1234)
    batched = _generate(Sampler(CPU), steps, params, seed=1234, batch_sizes=(8, 3, 6, 8, 2))
    # Small chunks split the sampled rows of a step into several passes.
    chunked = _generate(
        Sampler(CPU, chunk_elements=2 * 3000), steps, params, seed=1234, batch_sizes=(8, 5)
    )
    assert alone == batched == chunked
    assert len(set(alone)) > 1


def test_different_seeds_give_different_sequences() -> None:
    steps = [_logits(1, 1000, seed=200 + t, scale=0.5)[0] for t in range(20)]
    sampler = Sampler(CPU)
    runs = {tuple(_generate(sampler, steps, SamplingParams(), seed=s)) for s in range(10)}
    assert len(runs) == 10


def test_hash_stream_matches_documented_scheme() -> None:
    """With flat logits the draw is the token with the largest hash, so the documented
    integer scheme (and users' seeded outputs across versions) is pinned exactly."""
    m = sampler_mod._mix32_int
    mask = 0xFFFF_FFFF
    vocab = 64

    def expected_token(seed: int, step: int) -> int:
        s = m(m((seed & mask) ^ sampler_mod._SEED_SALT) ^ ((seed >> 32) & mask))
        key = m(s ^ step)
        h = [m(key ^ m(v ^ sampler_mod._VOCAB_SALT)) for v in range(vocab)]
        return max(range(vocab), key=h.__getitem__)

    cases = [(0, 0), (1, 0), (1, 1), (2**40 + 5, 3), (-7, 9), (123456789, 1000)]
    logits = torch.zeros(len(cases), vocab)
    got = Sampler(CPU).sample(
        logits,
        [SamplingParams()] * len(cases),
        [s for s, _ in cases],
        [[0] * step for _, step in cases],
    )
    assert got.tolist() == [expected_token(s, t) for s, t in cases]
    assert got.tolist() == [46, 34, 19, 9, 46, 22]  # golden: changing these breaks users' seeds


def test_device_hash_equals_python_hash() -> None:
    xs = [0, 1, 2, 0x7FFF_FFFF, 0x8000_0000, 0xDEAD_BEEF, 0xFFFF_FFFF]
    got = sampler_mod._mix32_(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [sampler_mod._mix32_int(x) for x in xs]


def test_presence_and_frequency_penalties_steer_greedy() -> None:
    logits = torch.tensor([[5.0, 4.5, 1.0, 0.0]])
    sampler = Sampler(CPU)

    def pick(params: SamplingParams, generated: list[int]) -> int:
        return int(sampler.sample(logits, [params], [0], [generated])[0])

    assert pick(GREEDY, [0]) == 0
    assert pick(SamplingParams(temperature=0.0, presence_penalty=1.0), [0]) == 1
    assert pick(SamplingParams(temperature=0.0, presence_penalty=1.0), [1]) == 0
    # frequency counts repeats: 5 - 0.4 > 4.5, but 5 - 0.8 < 4.5
    assert pick(SamplingParams(temperature=0.0, frequency_penalty=0.4), [0]) == 0
    assert pick(SamplingParams(temperature=0.0, frequency_penalty=0.4), [0, 0]) == 1
    # a negative presence penalty favours repeating
    assert pick(SamplingParams(temperature=0.0, presence_penalty=-1.0), [1]) == 1


def test_presence_penalty_lowers_sampled_frequency_by_exp_penalty() -> None:
    n = 20_000
    logits = torch.zeros(n, 4)  # [n, 4] uniform
    params = [SamplingParams(presence_penalty=2.0)] * n
    draws = Sampler(CPU).sample(logits, params, list(range(n)), [[3]] * n)
    freq = (draws == 3).double().mean().item()
    expected = math.exp(-2.0) / (3 + math.exp(-2.0))
    assert abs(freq - expected) < 0.006


def test_caller_logits_are_not_modified() -> None:
    logits = _logits(4, 100, seed=7)
    before = logits.clone()
    params = [SamplingParams(top_p=0.5, min_p=0.1, top_k=10, presence_penalty=1.0)] * 4
    Sampler(CPU).sample(logits, params, [1, 2, 3, 4], [[1, 2]] * 4)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("seed", "42"),
        ("seed", 1.0),
    ],
)
def test_invalid_params_raise_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_boundary_params_are_accepted() -> None:
    SamplingParams(
        temperature=0,
        top_p=1,
        top_k=-1,
        min_p=1,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=-(2**70),
    )
    assert GREEDY.greedy and not SamplingParams().greedy


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_give_the_same_tokens(dtype: torch.dtype) -> None:
    logits = _logits(8, 500, seed=8).to(dtype)  # [8, V] values exactly representable
    params = [GREEDY, SamplingParams(top_p=0.9, presence_penalty=0.5)] * 4
    seeds, outputs = list(range(8)), [[1, 2, 3]] * 8
    sampler = Sampler(CPU)
    got = sampler.sample(logits, params, seeds, outputs)
    assert got.dtype == torch.int64
    assert torch.equal(got, sampler.sample(logits.float(), params, seeds, outputs))


def test_no_host_readback_inside_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = _logits(6, 300, seed=9)
    params = [
        GREEDY,
        SamplingParams(),
        SamplingParams(top_k=5, top_p=0.8, min_p=0.05, frequency_penalty=1.0),
    ] * 2

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("host sync inside Sampler.sample")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    Sampler(CPU).sample(logits, params, list(range(6)), [[1, 1, 2]] * 6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_give_identical_seeded_samples() -> None:
    cuda = torch.device("cuda")
    params = [
        GREEDY,
        SamplingParams(),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=40,
            min_p=0.05,
            presence_penalty=0.5,
            frequency_penalty=0.5,
        ),
        SamplingParams(temperature=1.3, top_p=0.95),
    ] * 8
    n = len(params)
    outputs: list[list[int]] = [[] for _ in range(n)]
    on_cpu, on_cuda = Sampler(CPU), Sampler(cuda)
    for step in range(20):
        logits = _logits(n, 32_000, seed=300 + step, scale=3.0).to(torch.bfloat16)
        want = on_cpu.sample(logits, params, list(range(n)), outputs)
        logits_cuda = logits.to(cuda)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # sample() must not sync with the host
        try:
            got = on_cuda.sample(logits_cuda, params, list(range(n)), outputs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert got.device.type == "cuda"
        assert torch.equal(got.cpu(), want)
        outputs = [o + [t] for o, t in zip(outputs, want.tolist(), strict=True)]
