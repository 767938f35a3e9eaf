"""lz4 frame on real KV: compression ratio and speed, plain vs byte-plane shuffled.

Runs a ~2k-token byte-level prompt (real Python source text) through a small random
Llama-shaped decoder (RMSNorm, GQA attention with RoPE, SwiGLU) and snapshots the K/V
activations it produced, in fp32 and bf16. Prints markdown tables.

    python3 bench/snapshot_lz4.py [--tokens 2048] [--layers 8] [--hidden 1024]

MB = 1e6 bytes of raw (uncompressed) KV; each timing is the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import lz4.frame
import numpy as np
import torch
import torch.nn.functional as F

from ds4pool.kv.fingerprint import ModelFingerprint
from ds4pool.kv.layer_frames import _unshuffle, layer_frame
from ds4pool.kv.snapshot import Snapshot, decode_snapshot, encode_snapshot, write_snapshot


def prompt_bytes(num_tokens: int) -> list[int]:
    """Real text, the kind a coding agent sends: Python sources of torch.nn, byte-level."""
    text = b""
    for path in sorted((Path(torch.__file__).parent / "nn" / "modules").glob("*.py")):
        text += path.read_bytes()
        if len(text) >= num_tokens:
            break
    return list(text[:num_tokens])


def rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding, Llama's half-split convention. x: [T, H, D]."""
    T, _, D = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)  # [D/2]
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv_freq  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]  # [T, 1, D/2]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@torch.no_grad()
def real_kv(
    ids: list[int], num_layers: int, hidden: int, num_heads: int, num_kv_heads: int, seed: int = 0
) -> list[torch.Tensor]:
    """Prefill `ids` through a random Llama-shaped model; return per layer [2, T, Hkv, D]."""
    g = torch.Generator().manual_seed(seed)
    D, inter, T = hidden // num_heads, 2 * hidden, len(ids)

    def w(rows: int, cols: int) -> torch.Tensor:  # [out, in], the usual 1/sqrt(fan_in) scale
        return torch.randn(rows, cols, generator=g) / cols**0.5

    def rms(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    x = torch.randn(256, hidden, generator=g)[torch.tensor(ids)]  # [T, hidden]
    kv = []
    for _ in range(num_layers):
        h = rms(x)
        q = rope((h @ w(num_heads * D, hidden).T).view(T, num_heads, D))  # [T, H, D]
        k = rope((h @ w(num_kv_heads * D, hidden).T).view(T, num_kv_heads, D))  # [T, Hkv, D]
        v = (h @ w(num_kv_heads * D, hidden).T).view(T, num_kv_heads, D)
        kv.append(torch.stack([k, v]))  # [2, T, Hkv, D]
        rep = num_heads // num_kv_heads
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.repeat_interleave(rep, 1).transpose(0, 1),
            v.repeat_interleave(rep, 1).transpose(0, 1),
            is_causal=True,
        )  # [H, T, D]
        x = x + o.transpose(0, 1).reshape(T, hidden) @ w(hidden, hidden).T
        h = rms(x)
        x = x + (F.silu(h @ w(inter, hidden).T) * (h @ w(inter, hidden).T)) @ w(hidden, inter).T
    return kv


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def best_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def decompress(frames: list[bytes], like: list[torch.Tensor], shuffle: bool) -> list[object]:
    """Every layer kept alive, as a restore does: fresh memory (page faults) is part of it."""
    out: list[object] = []
    for frame, t in zip(frames, like):
        raw = lz4.frame.decompress(frame, return_bytearray=True)
        planes = np.frombuffer(raw, np.uint8)
        out.append(_unshuffle(planes, torch.empty_like(t)) if shuffle else raw)
    return out


def measure(name: str, snap: Snapshot, fp: ModelFingerprint, repeat: int) -> list[str]:
    """Table rows for plain and shuffled, then a line with the disk speed below which shuffling
    saves time: bytes it saves per raw MB / CPU seconds it adds per raw MB."""
    raw = sum(t.numel() * t.element_size() for t in snap.kv)
    rows, stored, times = [], {}, {}
    for shuffle in (False, True):
        frames = [layer_frame(t, shuffle) for t in snap.kv]
        data = encode_snapshot(snap, shuffle=shuffle)

        def compress(shuffle: bool = shuffle) -> None:
            for t in snap.kv:
                layer_frame(t, shuffle)

        def unpack(frames: list[bytes] = frames, shuffle: bool = shuffle) -> None:
            decompress(frames, snap.kv, shuffle)

        def encode(shuffle: bool = shuffle) -> None:
            # Into a sink that drops the bytes: the CPU cost of the format, not of a disk.
            write_snapshot(_Sink(), snap, shuffle=shuffle)

        def decode(data: bytes = data) -> None:
            decode_snapshot(data, fp)

        times[shuffle] = [best_time(f, repeat) for f in (compress, unpack, encode, decode)]
        stored[shuffle] = sum(len(f) for f in frames)
        mbs = " | ".join(f"{raw / t / 1e6:,.0f}" for t in times[shuffle])
        rows.append(
            f"| {name} | {'shuffled' if shuffle else 'plain'} | {raw / 1e6:.1f} | "
            f"{stored[shuffle] / 1e6:.1f} | {raw / stored[shuffle]:.3f} | {mbs} |"
        )
    saved = (stored[False] - stored[True]) / 1e6
    write_s, read_s = (times[True][i] - times[False][i] for i in (2, 3))
    even = [f"{saved / s:,.0f} MB/s" if s > 0 else "any speed" for s in (write_s, read_s)]
    notes = (
        f"- {name}: shuffling saves {saved / (raw / 1e6):.0%} of the raw bytes; it saves "
        f"time only on disks slower than {even[0]} (write) / {even[1]} (read)"
    )
    return rows + [notes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    t0 = time.perf_counter()
    ids = prompt_bytes(args.tokens)
    kv32 = real_kv(ids, args.layers, args.hidden, args.heads, args.kv_heads)
    t_model = time.perf_counter() - t0
    D = args.hidden // args.heads
    cases = []
    for dtype in ("float32", "bfloat16"):
        fp = ModelFingerprint("bench-llama", args.layers, args.kv_heads, D, dtype, "random-seed-0")
        kv = [t.to(fp.torch_dtype) for t in kv32]
        cases.append((f"real KV {dtype}", fp, kv))
    noise = [torch.randn_like(t).to(torch.bfloat16) for t in kv32]
    fp16 = ModelFingerprint("bench-llama", args.layers, args.kv_heads, D, "bfloat16", "noise")
    cases.append(("N(0,1) noise bfloat16 (control)", fp16, noise))

    print(
        f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
        f"{args.kv_heads} KV heads, head_dim {D}; prompt {len(ids)} byte tokens of "
        f"torch/nn/modules/*.py; prefill {t_model:.1f} s; torch {torch.__version__}, "
        f"lz4 {lz4.library_version_string()}, {platform.machine()}, "
        f"{torch.get_num_threads()} threads\n"
    )
    print(
        "| KV | layout | raw MB | stored MB | ratio | (shuffle+) lz4 compress MB/s "
        "| lz4 decompress (+unshuffle) MB/s | encode_snapshot MB/s | decode_snapshot MB/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    notes = []
    for name, fp, kv in cases:
        snap = Snapshot.create("bench", "s", fp, ids, bytes(ids).decode("latin-1"), kv)
        *rows, note = measure(name, snap, fp, args.repeat)
        print("\n".join(rows))
        notes.append(note)
    print("\n" + "\n".join(notes))

    blob = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8).numpy().tobytes()
    print("\n| checksum (stdlib) | MB/s |\n|---|---:|")
    for name, fn in [
        ("zlib.crc32", lambda: zlib.crc32(blob)),
        ("zlib.adler32", lambda: zlib.adler32(blob)),
        ("hashlib.blake2b", lambda: hashlib.blake2b(blob).digest()),
        ("hashlib.sha256", lambda: hashlib.sha256(blob).digest()),
    ]:
        print(f"| {name} | {len(blob) / best_time(fn, args.repeat) / 1e6:,.0f} |")


if __name__ == "__main__":
    main()
