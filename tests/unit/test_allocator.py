"""ds4pool/allocator.py: with glibc's mmap threshold fixed, session-sized buffers (1.5 MB,
as a session's KV moving between tiers) go back to the kernel when freed, where glibc's
default keeps them resident under younger small allocations. Runs in subprocesses: the
setting is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds4pool.allocator import fix_mmap_threshold

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import sys
import torch
from ds4pool.allocator import fix_mmap_threshold

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

if sys.argv[1] == "fixed" and not fix_mmap_threshold({}):
    print("unsupported")
    raise SystemExit(0)
first = torch.empty(3 << 19, dtype=torch.uint8).fill_(1)
del first  # the first large free: glibc's default raises its threshold here
before = rss()
big, small = [], []
for _ in range(40):  # 60 MB of session-sized buffers, a small allocation after each
    big.append(torch.empty(3 << 19, dtype=torch.uint8).fill_(1))
    small.append(torch.empty(1024, dtype=torch.uint8).fill_(1))
big.clear()
print((rss() - before) >> 20)
"""


def retained_mib(mode: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_freed_session_buffers_leave_the_resident_set() -> None:
    fixed = retained_mib("fixed")
    if fixed == "unsupported":
        pytest.skip("the C library is not glibc")
    default = retained_mib("default")
    assert int(fixed) <= 4, f"{fixed} MiB of 60 freed stayed resident with the threshold fixed"
    # the control: what the setting is for (glibc's default keeps most of them)
    assert int(default) >= 30, f"glibc's default kept only {default} MiB: the probe shows nothing"


def test_a_threshold_the_user_exported_wins() -> None:
    assert fix_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "65536"}) is False
