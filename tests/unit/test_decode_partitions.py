"""The decode kernel's split-K rule (`decode_partition_size`): shapes in, a partition size out.

No kernel runs here (the kernels' numerics are tests/unit/test_triton_attention.py's); this
checks what the rule promises a long context: enough live programs to fill the GPU, while a
short context stays one piece (no reduce launch).
"""

from __future__ import annotations

import pytest

from ds4pool.model.attention_triton import decode_partition_size

SMS = 132  # an H200


def live_programs(batch: int, kv_heads: int, width: int, context: int) -> int:
    size = decode_partition_size(batch, kv_heads, width, SMS)
    assert size % 64 == 0 and size >= 256
    return batch * kv_heads * -(-context // size)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_a_short_table_is_never_split(batch: int) -> None:
    assert decode_partition_size(batch, 8, 1024, SMS) == 1024  # one piece: no reduce


@pytest.mark.parametrize(
    ("batch", "width", "context"),
    [
        (16, 16384, 8320),
        (16, 16384, 4200),
        (32, 4096, 3000),
        (8, 4096, 1100),
        (64, 16384, 8320),
        (1, 16384, 8320),
    ],
)
def test_a_long_context_fills_the_gpu(batch: int, width: int, context: int) -> None:
    # a context anywhere in its width bucket (a quarter of it up to all of it) gets >= ~2
    # live programs per SM, where one program per (row, kv head) would leave SMs idle
    assert live_programs(batch, 8, width, context) >= min(2 * SMS, batch * 8 * context // 1024)


def test_pieces_shrink_with_the_batch_not_below_the_floor() -> None:
    sizes = [decode_partition_size(b, 8, 65536, SMS) for b in (1, 4, 16, 64)]
    assert sizes == sorted(sizes) and sizes[0] == 256


def test_one_long_context_is_not_left_to_a_few_programs() -> None:
    # batch 1 at 3k tokens (a 4k-wide table): 1,024-token pieces were 24 programs
    assert live_programs(1, 8, 4096, 3072) >= 96


@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_pieces_are_whole_tiles_of_the_launch(block_n: int) -> None:
    # paged_decode needs partition_size % block_n == 0 for the table's tile width
    for batch, width in [(1, 4096), (8, 16384), (64, 16384), (3, 5000)]:
        assert decode_partition_size(batch, 8, width, SMS, align=block_n) % max(64, block_n) == 0


@pytest.mark.parametrize(("heads", "batch"), [(16, 1), (16, 8), (128, 1), (128, 32)])
def test_mla_decode_splits_by_head_blocks(heads: int, batch: int) -> None:
    """The MLA backend's rule is this one over blocks of 16 heads (one latent read each): a
    DeepSeek-V3 context of 4,200 keys in a 16k-wide table keeps >= 2 live programs per SM
    where the batch alone would not, and a short table stays one piece."""
    pytest.importorskip("triton")
    from ds4pool.model.attention_mla_triton import TritonMLAAttention

    backend = TritonMLAAttention(num_sms=SMS)
    assert backend.partition_size(batch, heads, 1024) == 1024
    size = backend.partition_size(batch, heads, 16384)
    blocks = -(-heads // 16)
    assert size == decode_partition_size(batch, blocks, 16384, SMS)
    assert batch * blocks * -(-4200 // size) >= min(2 * SMS, batch * blocks * 4200 // 256)
