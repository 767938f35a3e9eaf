"""Text marks: where a diverging prompt resumes a session's (non-canonical) tokens."""

from __future__ import annotations

import random

from ds4pool.kv.match import common_prefix_len
from ds4pool.kv.prefix import common_text_prefix, resume_point, valid_marks


def test_common_text_prefix() -> None:
    assert common_text_prefix("abcdef", "abcxyz") == 3
    assert common_text_prefix("abc", "abcdef") == 3
    assert common_text_prefix("", "abc") == 0
    assert common_text_prefix("x" * 100_000 + "a", "x" * 100_000 + "b") == 100_000


def test_resume_point_takes_the_last_mark_inside_the_common_text() -> None:
    ids = [1, 2, 3, 4, 5, 6]
    text = "AAAABBBBCC"  # marks: 2 tokens = "AAAA", 4 tokens = "AAAABBBB"
    marks = [(2, 4), (4, 8)]
    assert resume_point(marks, ids, text, "AAAABBBBCC and more") == (6, 10)  # the full state
    assert resume_point(marks, ids, text, "AAAABBBBXX") == (4, 8)
    assert resume_point(marks, ids, text, "AAAABBXX") == (2, 4)
    assert resume_point(marks, ids, text, "AXXX") == (0, 0)
    assert resume_point(marks, ids, "", "AAAA") == (0, 0)  # unknown text: nothing is known


def test_valid_marks_drop_what_no_longer_fits() -> None:
    assert valid_marks([(2, 4), (4, 8)], 3, 10) == [(2, 4)]
    assert valid_marks([(2, 4)], 3, 0) == []


def test_common_prefix_len_is_the_first_difference() -> None:
    """The slice-wise comparison gives what an item-by-item loop gives: equal lists, one a
    prefix of the other, a difference at the start, at the end, around its 32-item steps."""

    def loop(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    rng = random.Random(3)
    base = [rng.randrange(1000) for _ in range(3000)]
    cases = [([], []), ([], [1]), (base, base), (base, base[:1234]), (base, [*base, 5])]
    for at in (0, 1, 31, 32, 33, 63, 64, 1500, 2999):
        cases.append((base, [*base[:at], -1, *base[at + 1 :]]))
    for _ in range(300):
        n = rng.randrange(200)
        a = [rng.randrange(2) for _ in range(n)]
        b = a[: rng.randrange(n + 1)] + [rng.randrange(2) for _ in range(rng.randrange(50))]
        cases.append((a, b))
    for a, b in cases:
        assert common_prefix_len(a, b) == common_prefix_len(b, a) == loop(a, b)
