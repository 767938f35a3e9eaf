"""Which compiled variant each Triton launch would need, recorded instead of run (no GPU).

Triton compiles a @triton.jit kernel once per key: the constexpr values, the launch options
(num_warps, num_stages, launch_pdl) and, for every other argument, its type and Triton's
specialisation of it (an int equal to 1 or divisible by 16, a pointer 16-byte aligned),
unless the kernel lists the argument in do_not_specialize. `VariantRecorder` replaces
`JITFunction.run` (what `kernel[grid](...)` calls) by a function that computes that key with
Triton's own specialisation routine and returns without launching, so a CPU test can drive
the real runner with a Triton backend over many step shapes and see which launches would
compile. The kernels' outputs stay whatever torch.empty left in them: only shapes and
launches are meaningful in such a run, not values.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

Key = tuple[tuple[Any, ...], tuple[tuple[str, Any], ...]]


def _triton_internals() -> tuple[Any, Any, Any]:
    try:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import JITFunction, native_specialize_impl
    except ImportError as exc:  # no triton, or one whose internals moved
        pytest.skip(f"Triton's launch specialisation is not reachable here: {exc}")
    return JITFunction, native_specialize_impl, BaseBackend


@dataclass
class VariantRecorder:
    """Per kernel name, each key seen and the label of the first launch that needed it."""

    seen: dict[str, dict[Key, str]] = field(default_factory=dict)
    label: str = ""

    def key(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
        _, specialize, backend = _triton_internals()
        names = [p.name for p in fn.params]
        bound = dict(zip(names, args))
        options = {k: v for k, v in kwargs.items() if k not in names}
        bound.update({k: v for k, v in kwargs.items() if k in names})
        defaults = inspect.signature(fn.fn).parameters
        parts: list[Any] = []
        for p in fn.params:
            value = bound[p.name] if p.name in bound else defaults[p.name].default
            if p.is_constexpr:
                parts.append((p.name, "constexpr", value))
                continue
            align = not getattr(p, "do_not_specialize_on_alignment", False)
            parts.append(
                (p.name, specialize(backend, value, p.is_const, not p.do_not_specialize, align))
            )
        return tuple(parts), tuple(sorted(options.items()))

    def variants(self) -> dict[str, set[Key]]:
        return {name: set(keys) for name, keys in self.seen.items()}

    def new_since(self, before: dict[str, set[Key]]) -> list[str]:
        """One line per key not in `before`: kernel, the launch that needed it, and what
        differs from a key of `before` (the nearest: fewest differing parts)."""
        lines = []
        for name, keys in self.seen.items():
            old = before.get(name, set())
            for key, label in keys.items():
                if key in old:
                    continue
                lines.append(f"{name} at {label}: {_nearest_difference(key, old)}")
        return lines


def _nearest_difference(key: Key, others: set[Key]) -> str:
    if not others:
        return "a kernel not launched before"

    def diff(other: Key) -> list[str]:
        args = [f"{a} vs {b}" for a, b in zip(key[0], other[0]) if a != b]
        return args + ([f"options {key[1]} vs {other[1]}"] if key[1] != other[1] else [])

    return "; ".join(min((diff(o) for o in others), key=len))


@contextmanager
def recording() -> Iterator[VariantRecorder]:
    """Within the block, Triton launches are recorded by the yielded recorder, not run."""
    jit, _, _ = _triton_internals()
    recorder = VariantRecorder()

    def run(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        key = recorder.key(fn, args, kwargs)
        recorder.seen.setdefault(f"{fn.fn.__module__}.{fn.fn.__name__}", {}).setdefault(
            key, recorder.label
        )

    original = jit.run
    jit.run = run
    try:
        yield recorder
    finally:
        jit.run = original
