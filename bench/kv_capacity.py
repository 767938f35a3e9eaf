"""KV bytes per token and how many sessions each tier holds, computed from model configs.

    python bench/kv_capacity.py                 # the table of docs/BENCHMARKS.md
    python bench/kv_capacity.py --tokens 8192 --device-gib 40

No model is built: the numbers follow from the configs (ModelConfig.kv_bytes_per_token, the
same figure the runner sizes its block pool with). `random:deepseek-v3-small` caches the MLA
latent; next to it are GQA/MHA models with the same 27 layers and 16 query heads, as the same
model would cache them without the latent, and the Qwen3-30B-A3B-shaped preset for scale.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.model.demo import preset_config  # noqa: E402

GIB = 1 << 30
TB = 10**12  # disks are sold in decimal terabytes


@dataclass(frozen=True)
class Row:
    name: str
    cache: str  # what one token stores per layer
    bytes_per_token: int


def rows(element_size: int) -> list[Row]:
    mla = preset_config("random:deepseek-v3-small")
    assert mla.mla is not None
    m = mla.mla
    layers = mla.num_layers
    heads = mla.num_heads

    def gqa(kv_heads: int, k_dim: int, v_dim: int) -> int:
        return layers * kv_heads * (k_dim + v_dim) * element_size

    qwen = preset_config("random:qwen3-30b-a3b")
    return [
        Row(
            "random:deepseek-v3-small (MLA latent)",
            f"1 × ({m.kv_lora_rank} + {m.qk_rope_head_dim})",
            mla.kv_bytes_per_token(element_size),
        ),
        Row(
            "same model, up-projected K/V cached (MHA)",
            f"{heads} × ({m.qk_head_dim} K + {m.v_head_dim} V)",
            gqa(heads, m.qk_head_dim, m.v_head_dim),
        ),
        Row("GQA 16/8, head_dim 128, 27 layers", "8 × (128 + 128)", gqa(8, 128, 128)),
        Row("GQA 16/4, head_dim 128, 27 layers", "4 × (128 + 128)", gqa(4, 128, 128)),
        Row(
            "random:qwen3-30b-a3b (GQA 32/4, 48 layers)",
            "4 × (128 + 128)",
            qwen.kv_bytes_per_token(element_size),
        ),
    ]


def table(tokens: int, device_gib: float, ram_gib: float, disk_tb: float, element_size: int) -> str:
    head = (
        "model",
        "cached per token and layer",
        "KV B/token",
        f"one {tokens // 1024}k session",
        f"sessions in {device_gib:g} GiB device",
        f"in {ram_gib:g} GiB RAM",
        f"in {disk_tb:g} TB disk",
    )
    lines = ["| " + " | ".join(head) + " |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows(element_size):
        per_session = r.bytes_per_token * tokens
        counts = (
            int(device_gib * GIB // per_session),
            int(ram_gib * GIB // per_session),
            int(disk_tb * TB // per_session),
        )
        lines.append(
            f"| {r.name} | {r.cache} | {r.bytes_per_token:,} | {per_session / GIB:.2f} GiB | "
            + " | ".join(f"{c:,}" for c in counts)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768, help="tokens per session")
    p.add_argument("--device-gib", type=float, default=100.0)
    p.add_argument("--ram-gib", type=float, default=64.0)
    p.add_argument("--disk-tb", type=float, default=1.0)
    p.add_argument("--element-size", type=int, default=2, help="KV bytes per value (bf16: 2)")
    a = p.parse_args()
    print(table(a.tokens, a.device_gib, a.ram_gib, a.disk_tb, a.element_size))


if __name__ == "__main__":
    main()
