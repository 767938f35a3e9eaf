"""Text marks: where a diverging prompt resumes a session's (non-canonical) tokens."""

from __future__ import annotations

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
