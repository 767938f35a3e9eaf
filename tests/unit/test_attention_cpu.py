"""The CPU attention path against the gathering reference, over random paged caches."""

from __future__ import annotations

import pytest
import torch

from ds4pool.model import attention_cpu
from ds4pool.model.attention import TorchPagedAttention, build_metadata
from ds4pool.model.attention_cpu import GROUP_BYTES, decode_groups

BS = 4
D = 8


@pytest.fixture
def one_thread():
    """One torch thread, as the server runs the model on a 2-core box (--cpu-threads auto).
    With more, the fused CPU kernel's split of a call across threads can change a row's last
    bits with the call's batch size on some CPUs (a 2-core EPYC: a row alone vs in a batch of
    5), so the bitwise claims hold per thread count, and are checked with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_step(
    query_lens: list[int],
    context_lens: list[int],
    h_kv: int,
    seed: int,
    group: int = 2,
    fifo: bool = False,
    head_major: bool = False,
) -> tuple[list[list[int]], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables from shuffled ids, or (fifo) runs of consecutive ids as the block pool
    hands them out, every other sequence's reversed; a cache of noise (in either memory
    order of KVLayout: the same values); this step's q, k, v."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-c // BS) + 1 for c in context_lens]  # one spare block past each context
    num_blocks = sum(need) + 3
    ids = list(range(3, num_blocks)) if fifo else torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = [], 0
    for i, n in enumerate(need):
        tables.append(ids[at : at + n][:: -1 if fifo and i % 2 else 1])
        at += n
    cache = torch.randn(2, num_blocks, BS, h_kv, D, generator=gen)
    if head_major:
        memory = torch.empty(2, h_kv, num_blocks, BS, D)  # what KVLayout allocates on CPU
        cache = memory.permute(0, 2, 3, 1, 4).copy_(cache)
    t = sum(query_lens)
    q = torch.randn(t, group * h_kv, D, generator=gen)  # group query heads per KV head
    k = torch.randn(t, h_kv, D, generator=gen)
    v = torch.randn(t, h_kv, D, generator=gen)
    return tables, cache, q, k, v


def attend(
    backend: TorchPagedAttention,
    query_lens: list[int],
    context_lens: list[int],
    window: int | None = None,
    heads: tuple[int, int] = (2, 2),
    seed: int = 0,
    head_major: bool = False,
) -> torch.Tensor:
    h_kv, group = heads
    fifo = seed % 2 == 1  # odd seeds: consecutive block runs (attended in place)
    tables, cache, q, k, v = random_step(
        query_lens, context_lens, h_kv, seed, group, fifo, head_major
    )
    meta = build_metadata(query_lens, context_lens, tables, BS, torch.device("cpu"), window)
    return backend.forward(q, k, v, cache, meta, scale=D**-0.5)


CASES = {
    "equal decodes": ([1] * 5, [37] * 5),
    "ragged decodes": ([1] * 6, [1, 2, 9, 40, 41, 130]),
    "block-aligned decodes": ([1] * 3, [4, 8, 64]),
    "long decodes": ([1] * 3, [203, 140, 9]),  # with FIFO ids, the first is attended in place
    "first chunks": ([7, 12], [7, 12]),
    "later chunks": ([5, 9], [23, 9 + 40]),
    "chunks mixed with decodes": ([1, 6, 1, 13, 1], [50, 6, 3, 29, 120]),
}


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("window", [None, 10, 150])
@pytest.mark.parametrize("heads", [(1, 2), (2, 3), (2, 1)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_the_gathering_reference(
    case: str, heads: tuple[int, int], window: int | None, head_major: bool
) -> None:
    # the reference reads a token-major cache; the CPU path either order of the same values
    query_lens, context_lens = CASES[case]
    for seed in range(4):
        fast = attend(
            TorchPagedAttention(), query_lens, context_lens, window, heads, seed, head_major
        )
        ref = attend(
            TorchPagedAttention(cpu_kernels=False), query_lens, context_lens, window, heads, seed
        )
        assert fast.shape == ref.shape
        assert (fast - ref).abs().max().item() < 1e-5, (case, seed)


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
def test_a_decode_does_not_depend_on_its_neighbours(head_major: bool) -> None:
    # The long neighbours put the short sequence in a group of its own or pad it; either way
    # it must see exactly its own keys.
    lens = [200, 9, 190, 60]
    together = attend(TorchPagedAttention(), [1] * 4, lens, head_major=head_major)
    tables, cache, q, k, v = random_step([1] * 4, lens, 2, 0, head_major=head_major)
    backend = TorchPagedAttention()
    for i in range(4):
        meta = build_metadata([1], [lens[i]], [tables[i]], BS, torch.device("cpu"))
        alone = backend.forward(q[i : i + 1], k[i : i + 1], v[i : i + 1], cache, meta, D**-0.5)
        assert (alone[0] - together[i]).abs().max().item() < 1e-6


def test_decode_groups_bound_padding_and_bytes() -> None:
    counts = [100, 3, 80, 76, 74, 2, 40, 99]
    groups = decode_groups(counts, block_bytes=GROUP_BYTES // 250)
    assert sorted(i for g in groups for i in g) == list(range(len(counts)))
    for g in groups:
        longest = max(counts[i] for i in g)
        assert all(longest - counts[i] <= max(8, 0.25 * longest) for i in g)
        assert len(g) * longest <= 250
    # [100, 99], [80, 76, 74], [40], [3, 2]: 100 + 99 + 80 would pass the byte budget
    assert [sorted(counts[i] for i in g) for g in groups] == [[99, 100], [74, 76, 80], [40], [2, 3]]


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("window", [None, 150])
def test_rows_on_a_shared_prefix_are_attended_in_place_and_exactly(
    window: int | None, head_major: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Agents on one system prompt: each table is the prefix's run of blocks, then the row's
    # own run (and a third after a copy-on-write block). Long enough to be attended in place:
    # the merge of the runs' partial softmaxes must equal one softmax over all the keys.
    # Window 150 (38 blocks): row 0 cuts into the prefix, row 1 sees only its own blocks,
    # row 2 the prefix's last 8, the copied block between its own and four runs in all.
    h_kv, group, prefix = 2, 3, 40
    lens = [170, 330, 280]
    assert 150 // BS >= attention_cpu.VIEW_MIN_BLOCKS and attention_cpu.MAX_RUNS >= 4
    gen = torch.Generator().manual_seed(5)
    own = [-(-c // BS) - prefix for c in lens]
    at = prefix
    tables = []
    for n in own:
        tables.append(list(range(prefix)) + list(range(at, at + n)))
        at += n
    tables[2][prefix + 3] = at  # a block copied on write: a third run, then the fourth
    num_blocks = at + 1
    ref_cache = torch.randn(2, num_blocks, BS, h_kv, D, generator=gen)
    cache = ref_cache.clone()
    if head_major:
        cache = torch.empty(2, h_kv, num_blocks, BS, D).permute(0, 2, 3, 1, 4).copy_(cache)
    q = torch.randn(3, group * h_kv, D, generator=gen)
    k, v = torch.randn(2, 3, h_kv, D, generator=gen)
    meta = build_metadata([1] * 3, lens, tables, BS, torch.device("cpu"), window)
    ref = TorchPagedAttention(cpu_kernels=False).forward(q, k, v, ref_cache, meta, D**-0.5)

    def no_gather(*args: object) -> torch.Tensor:
        raise AssertionError("a row of few runs was gathered")

    monkeypatch.setattr(attention_cpu, "_gather_heads", no_gather)
    fast = TorchPagedAttention().forward(q, k, v, cache, meta, D**-0.5)
    assert (fast - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("head_major", [False, True], ids=["token-major", "head-major"])
@pytest.mark.parametrize("window", [None, 190])
def test_agents_on_a_shared_prefix_read_it_in_place_once_a_layer(
    window: int | None, head_major: bool, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    # Agents on one system prompt, as a server's tables look after their prompts and replies
    # were written in turns: the shared prefix's run, then each row's own blocks between the
    # other rows' (one run each, more than MAX_RUNS). The prefix is attended in place for
    # every row in one kernel call (their queries stacked), only the rows' own blocks are copied;
    # the result is the reference's, and each row's bits are the same alone as in the batch
    # (their own parts are of one length: no padding in the gathered group).
    h_kv, group, prefix, own, rows = 2, 3, 50, 6, 5
    assert prefix >= attention_cpu.VIEW_MIN_BLOCKS and own > attention_cpu.MAX_RUNS
    gen = torch.Generator().manual_seed(8)
    # (block `prefix` is someone else's: no row's own blocks continue the prefix's run)
    tables = [
        list(range(prefix)) + [prefix + 1 + r + rows * j for j in range(own)] for r in range(rows)
    ]
    lens = [(prefix + own) * BS - 1] * rows
    num_blocks = prefix + rows * own + 2
    ref_cache = torch.randn(2, num_blocks, BS, h_kv, D, generator=gen)
    cache = ref_cache.clone()
    if head_major:
        cache = torch.empty(2, h_kv, num_blocks, BS, D).permute(0, 2, 3, 1, 4).copy_(cache)
    q = torch.randn(rows, group * h_kv, D, generator=gen)
    k, v = torch.randn(2, rows, h_kv, D, generator=gen)
    meta = build_metadata([1] * rows, lens, tables, BS, torch.device("cpu"), window)
    ref = TorchPagedAttention(cpu_kernels=False).forward(q, k, v, ref_cache.clone(), meta, D**-0.5)
    gathered: list[int] = []
    gather = attention_cpu._gather_heads
    flash = attention_cpu._flash
    calls: list[tuple[int, int]] = []  # (batch entries, queries an entry) per kernel call

    def counting_gather(plane: torch.Tensor, blocks: torch.Tensor, *args: object) -> torch.Tensor:
        gathered.append(blocks.numel())
        return gather(plane, blocks, *args)  # type: ignore[arg-type]

    def counting_flash(q_: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((q_.shape[0], q_.shape[2]))
        return flash(q_, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_cpu, "_gather_heads", counting_gather)
    monkeypatch.setattr(attention_cpu, "_flash", counting_flash)
    fast = TorchPagedAttention().forward(q, k, v, cache, meta, D**-0.5)
    assert (fast - ref).abs().max().item() < 1e-5
    assert max(gathered) <= rows * own  # K and V of the rows' own blocks, never the prefix
    # the prefix: one call for all the rows' queries (stacked fold_rows rows to an entry),
    # before the own parts
    per = attention_cpu.fold_rows(group)
    assert calls[0] == (-(-rows // per), per * group)
    for r in range(rows):
        alone = build_metadata(
            [1], lens[r : r + 1], tables[r : r + 1], BS, torch.device("cpu"), window
        )
        one = TorchPagedAttention().forward(
            q[r : r + 1], k[r : r + 1], v[r : r + 1], cache, alone, D**-0.5
        )
        assert torch.equal(one[0], fast[r]), r


def test_a_row_of_one_run_gets_the_fused_kernels_bits(one_thread: None) -> None:
    """In place, a row of one run goes through the kernel that returns log-sum-exps (to be
    merged with other pieces where there are any), its queries padded with zero queries to
    invariant_queries if fewer: alone its output is the same bits as
    scaled_dot_product_attention's over the same keys and a full entry of stacked queries
    (nothing else rounds it), and within rounding of its own queries alone."""
    gen = torch.Generator().manual_seed(2)
    h_kv, group, n = 2, 3, 40
    cache = torch.randn(2, n + 1, BS, h_kv, D, generator=gen)
    q = torch.randn(1, group * h_kv, D, generator=gen)
    ctx = n * BS - 2
    out = attention_cpu.paged_decode(q, cache, torch.arange(n + 1)[None], [ctx], D**-0.5)
    keys = cache[0].flatten(0, 1)[:ctx].transpose(0, 1)[None]  # [1, H_kv, ctx, D]
    values = cache[1].flatten(0, 1)[:ctx].transpose(0, 1)[None]
    per = attention_cpu.fold_rows(group)
    stacked = torch.zeros(1, h_kv, per * group, D)
    stacked[:, :, :group] = q.view(1, h_kv, group, D)
    want = torch.nn.functional.scaled_dot_product_attention(stacked, keys, values, scale=D**-0.5)
    assert torch.equal(out, want[:, :, :group].reshape(1, group * h_kv, D))
    own = torch.nn.functional.scaled_dot_product_attention(
        q.view(1, h_kv, group, D), keys, values, scale=D**-0.5
    )
    assert (out - own.reshape(1, group * h_kv, D)).abs().max().item() < 1e-6


@pytest.mark.parametrize("fewest", [None, "full"], ids=["measured", "no-smaller-count"])
def test_a_row_alone_on_its_slice_is_not_padded_to_a_full_entry(
    fewest: str | None, monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """A row that no other row of the step shares its slice with (an agent on its own
    prompt) is attended in an entry of its own G queries, padded only up to
    invariant_queries, not to a full stacked entry (which cost one row's layer 1.7-2.2x);
    yet its bits are those it gets when other rows share the slice and their queries fill
    full entries. Where the kernel agrees from no smaller count (no-smaller-count), the
    entry is padded to the full count, with the same bits. (head_dim 32: at the other tests'
    8 the kernel's bits on a Zen 1 EPYC depend on the count below a full entry, so the
    probe pads every entry and the shorter entry would go untested there.)"""
    d = 32
    gen = torch.Generator().manual_seed(3)
    h_kv, group, n, rows = 2, 3, 40, 7
    per = attention_cpu.fold_rows(group)
    assert rows > per  # two entries: a full one, then a padded one
    if fewest == "full":
        monkeypatch.setattr(attention_cpu, "invariant_queries", lambda *a: per * group)
    most = attention_cpu.invariant_queries(torch.float32, d, per * group)
    cache = torch.randn(2, n + 1, BS, h_kv, d, generator=gen)
    q = torch.randn(rows, group * h_kv, d, generator=gen)
    tables = torch.arange(n + 1)[None].expand(rows, -1)  # every row on one slice
    lens = [n * BS - 2] * rows
    flash = attention_cpu._flash
    calls: list[tuple[int, int]] = []  # (batch entries, queries an entry)

    def counting_flash(q_: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((q_.shape[0], q_.shape[2]))
        return flash(q_, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_cpu, "_flash", counting_flash)
    together = attention_cpu.paged_decode(q, cache, tables, lens, d**-0.5)
    assert calls == [(2, per * group)]
    for r in (0, per, rows - 1):  # first in a full entry, first and last of the padded one
        calls.clear()
        alone = attention_cpu.paged_decode(q[r : r + 1], cache, tables[:1], lens[:1], d**-0.5)
        assert calls == [(1, max(group, most))]
        assert torch.equal(alone[0], together[r]), r


def test_invariant_queries_finds_where_the_kernels_bits_stop_depending_on_the_count(
    monkeypatch: pytest.MonkeyPatch, one_thread: None
) -> None:
    """The probe against kernels that round differently: one whose bits change below 6
    queries an entry gives 6; one whose bits depend on a query's place in the entry gives
    the full count (every entry padded to it); the real kernel gives a count that it then
    keeps to, bit for bit, at these shapes."""
    flash = attention_cpu._flash

    def below_six(q_: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = flash(q_, *args)  # type: ignore[arg-type]
        return (o.nextafter(o + 1), lse) if q_.shape[2] < 6 else (o, lse)

    def by_place(q_: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = flash(q_, *args)  # type: ignore[arg-type]
        o = o.clone()
        o[:, :, 0] = o[:, :, 0].nextafter(o[:, :, 0] + 1)
        return o, lse

    probe = attention_cpu.invariant_queries
    try:
        attention_cpu._probe.cache_clear()
        monkeypatch.setattr(attention_cpu, "_flash", below_six)
        assert probe(torch.float32, 16, 15) == 6
        attention_cpu._probe.cache_clear()
        monkeypatch.setattr(attention_cpu, "_flash", by_place)
        assert probe(torch.float32, 16, 15) == 15
    finally:
        attention_cpu._probe.cache_clear()
        monkeypatch.setattr(attention_cpu, "_flash", flash)
    count = probe(torch.float32, 16, 15)
    assert 1 <= count <= 15
    gen = torch.Generator().manual_seed(4)
    full = torch.randn(1, 1, 15, 16, generator=gen)
    keys, values = torch.randn(2, 1, 1, 300, 16, generator=gen)
    o_full, _ = flash(full, keys, values, None, 0.25)
    o_few, _ = flash(full[:, :, :count], keys, values, None, 0.25)
    assert torch.equal(o_few, o_full[:, :, :count])


def test_a_steps_copies_reuse_one_buffer_across_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer of a step gathers the same blocks: the copies go to one buffer kept on the
    step's metadata (allocated once a step, not twice a layer), and the results are the
    same bits as with fresh copies."""
    lens = [300, 9, 190, 60]
    tables, cache, q, k, v = random_step([1] * 4, lens, 2, 0, head_major=True)
    meta = build_metadata([1] * 4, lens, tables, BS, torch.device("cpu"))
    backend = TorchPagedAttention()
    first = backend.forward(q, k, v, cache, meta, D**-0.5)
    buffers = [t for t in meta.derived.values() if isinstance(t, torch.Tensor)]
    assert len(buffers) == 1
    made: list[int] = []
    empty = torch.empty

    def counting_empty(*args: object, **kwargs: object) -> torch.Tensor:
        made.append(1)
        return empty(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_cpu.torch, "empty", counting_empty)
    second = backend.forward(q, k, v, cache, meta, D**-0.5)  # a second layer of the step
    assert not made
    monkeypatch.undo()
    fresh = backend.forward(
        q, k, v, cache, build_metadata([1] * 4, lens, tables, BS, torch.device("cpu")), D**-0.5
    )
    assert torch.equal(first, second) and torch.equal(first, fresh)


def test_a_gather_gives_each_heads_keys_in_block_order_in_either_memory_order() -> None:
    """_gather_heads: blocks [n] of a plane as [H_kv, n * bs, D], the same values from a
    head-major cache (rows of [H_kv * (N + 1), bs * D], precomputed or not, into a buffer
    or not) as from a token-major one, and as indexing the plane would give them."""
    from ds4pool.model.attention_cpu import _gather_heads, _head_rows

    h_kv, blocks = 3, torch.tensor([5, 0, 7, 7, 2])
    _, token_major, *_ = random_step([1], [100], h_kv, 3)
    _, head_major, *_ = random_step([1], [100], h_kv, 3, head_major=True)
    assert torch.equal(token_major, head_major)  # the same values, two memory orders
    want = token_major[0][blocks].permute(2, 0, 1, 3).flatten(1, 2)  # [H_kv, n * bs, D]
    assert _head_rows(token_major[0], blocks) is None
    rows = _head_rows(head_major[0], blocks)
    assert rows is not None and rows.numel() == h_kv * blocks.numel()
    buffer = torch.full((2 * want.numel() + 5,), float("nan"))
    for cache in (token_major, head_major):
        for buf, half in ((None, 0), (buffer, 0), (buffer, 1)):
            for pre in (None, _head_rows(cache[0], blocks)):
                got = _gather_heads(cache[0], blocks, buf, half, pre)
                assert got.shape == want.shape and torch.equal(got, want)
