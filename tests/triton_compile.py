"""Compile a Triton kernel for an H100/H200 (sm_90) on a machine without a GPU: the real
pipeline (not the interpreter, which accepts code the compiler rejects). The test modules that
use it skip themselves where triton is absent or the interpreter is on."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any


def compile_sm90(
    fn: Any,
    consts: dict[str, Any],
    num_warps: int,
    num_stages: int,
    *,
    pointers: Mapping[str, str],
    f32_scalars: Collection[str] = (),
    align_strides: bool = False,
    types: Mapping[str, str] | None = None,
    aligned: Collection[str] = (),
) -> Any:
    """fn's parameters typed by name: constexprs from `consts` (or their defaults), `*_ptr`
    from `pointers` (a Triton pointer type, "*bf16" where not named), scalars i32 unless in
    `f32_scalars`.
    Pointers (and strides, with align_strides) that are specialised get 16-byte divisibility,
    as launches with aligned tensors do. `types` types other parameters by name, e.g. a
    host tensor descriptor as "tensordesc<bf16[32,128]>"; `aligned` names more integers that
    launches pass as multiples of 16 (sizes), specialised as those launches are."""
    from triton import compiler
    from triton.backends.compiler import GPUTarget

    sig, attrs, consts = {}, {}, dict(consts)
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            if p.name not in consts and p.has_default:  # as a launch that leaves it out
                consts[p.name] = p.default
        elif types and p.name in types:
            sig[p.name] = types[p.name]
            continue
        elif p.name.endswith("_ptr"):
            sig[p.name] = pointers.get(p.name, "*bf16")
        else:
            sig[p.name] = "fp32" if p.name in f32_scalars else "i32"
        divisible = p.name.endswith("_ptr") or p.name in aligned
        divisible |= align_strides and p.name.startswith("stride")
        if divisible and not p.do_not_specialize:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = compiler.ASTSource(fn, sig, consts, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    return compiler.compile(
        src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages)
    )


def resource_usage(cubin: bytes) -> dict[str, int] | None:
    """{"REG": n, "LOCAL": bytes, ...} of the cubin's kernel; None without cuobjdump."""
    from triton.backends import nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    exe = str(tool) if tool.exists() else shutil.which("cuobjdump")
    if exe is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [exe, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    return {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d\])?):(\d+)", text)}
