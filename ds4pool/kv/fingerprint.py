"""The model fingerprint of snapshot and block files: what the KV bytes depend on (architecture,
shapes, KV dtype and layout, weights id), its stable digest, and its JSON form in a header."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from typing import Any

import torch

from ds4pool.kv.framing import get_field

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# What each token's KV holds per layer, planes of [num_kv_heads, head_dim] (KVLayout's kinds):
# "kv": K then V of every KV head; "mla": one plane, the compressed latent of multi-head
# latent attention (num_kv_heads 1, head_dim kv_lora_rank + qk_rope_head_dim). The file
# format names its own kinds (model/kv_layout.py's KVLayout has the same two): kv/ does not
# import the model.
PLANES_OF: dict[str, int] = {"kv": 2, "mla": 1}
DEFAULT_KV_LAYOUT = "kv"


@dataclass(frozen=True)
class ModelFingerprint:
    """What the KV bytes depend on. Two models with equal digests produce interchangeable KV."""

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # KV dtype, a key of DTYPES
    weights_id: str  # hash of the weights, supplied by the model loader
    kv_layout: str = DEFAULT_KV_LAYOUT  # a key of PLANES_OF

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}; expected one of {list(DTYPES)}")
        if self.kv_layout not in PLANES_OF:
            raise ValueError(
                f"unsupported KV layout {self.kv_layout!r}; expected one of {list(PLANES_OF)}"
            )

    @property
    def num_planes(self) -> int:
        return PLANES_OF[self.kv_layout]

    def digest(self) -> str:
        """sha256 of the canonical JSON of all fields: stable across processes and versions.
        `kv_layout` joined the fingerprint after the first snapshots were written: at its
        default ("kv") it is left out, so those files keep their digest; any other layout is
        part of it, so a "kv" snapshot and an "mla" one can never match."""
        return self._digest

    @cached_property
    def _digest(self) -> str:  # a block-sharing restore checks one per block file: once
        doc = asdict(self)
        if doc["kv_layout"] == DEFAULT_KV_LAYOUT:
            del doc["kv_layout"]
        canonical = json.dumps(doc, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def fingerprint_json(fp: ModelFingerprint) -> dict[str, Any]:
    return {"fingerprint": asdict(fp), "fingerprint_digest": fp.digest(), "dtype": fp.dtype}


# Field name -> runtime type, for strict parsing (annotations are strings here).
_FINGERPRINT_TYPES = {f.name: int if f.type == "int" else str for f in fields(ModelFingerprint)}
# Keys a header written before they existed may lack: the default is what those files hold.
_FINGERPRINT_DEFAULTS = {"kv_layout": DEFAULT_KV_LAYOUT}


def parse_fingerprint(
    doc: dict[str, Any], expected: ModelFingerprint | None = None
) -> ModelFingerprint:
    """The fingerprint of a header doc; its redundant digest and dtype must agree. One equal
    to `expected` is returned as `expected` (its digest is computed once, not per file)."""
    fpd = {**_FINGERPRINT_DEFAULTS, **get_field(doc, "fingerprint", dict)}
    fp = ModelFingerprint(
        **{name: get_field(fpd, name, t) for name, t in _FINGERPRINT_TYPES.items()}
    )
    if expected is not None and fp == expected:
        fp = expected
    if (
        get_field(doc, "fingerprint_digest", str) != fp.digest()
        or get_field(doc, "dtype", str) != fp.dtype
    ):
        raise ValueError("fingerprint digest or dtype disagrees with the fingerprint")
    return fp
