"""Write a random-weight model of a preset's shape as a real Hugging Face directory, with
the demo tokenizer (byte-level BPE, 8,192 ids), so that other servers (llama.cpp's
converter, transformers) can load exactly the weights ds4pool serves.

    python bench/write_random_model.py --preset llama3-8b --vocab 8192 /tmp/m8b --device cuda
    python bench/write_random_model.py --preset 100m --vocab 1024 --dtype float32 /tmp/m77

The demo tokenizer has 1,024 ids: with a larger --vocab the model mostly samples ids that
decode to no text (llama.cpp pads its vocabulary the same way), which is fine for decode
speed but leaves an HTTP client nothing to time. The CPU multi-agent comparison with
llama-server uses the second command (77M parameters).

--text-ids-only zeroes the output rows (lm_head) of every id that does not decode to text on
its own: special tokens, ids past the tokenizer's, and the 162 of the demo tokenizer's 1,024
that are a fragment of a UTF-8 character (alone they decode to U+FFFD). Their logit is then
exactly 0 while the other ids' are random of either sign, so greedy decoding never picks one
(the largest of ~860 random logits is > 0). Every generated id then streams as text the step
it is sampled. Without it a random model samples such fragments as often as any id, and
servers that hold an incomplete character back (ds4pool, like vLLM) send two or more ids in
one streamed chunk where llama-server sends one each: an HTTP client's inter-token latency
is then a gap between chunks, not between tokens (docs/BENCHMARKS.md, session 31: 32 ids
came in 12-22 chunks from ds4pool, 32 from llama-server, for the same text). Use it for
workloads that time streamed text:

    python bench/write_random_model.py --preset 100m --vocab 1024 --dtype float32 \
        --text-ids-only /tmp/m77t

The peers' figures in ../shared/peers/README.md were measured on this shape (hidden 4096,
32 layers, GQA 32/8, vocab 8192: 7.05B parameters, 14.09 GB in bf16).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4pool.model import demo  # noqa: E402
from ds4pool.model.config import ModelConfig  # noqa: E402
from ds4pool.model.loader import build_empty  # noqa: E402
from ds4pool.model.tokenizer import Tokenizer  # noqa: E402

REPLACEMENT = "\ufffd"


def non_text_ids(tokenizer: Tokenizer, vocab: int) -> list[int]:
    """Ids of [0, vocab) that stream no text of their own: none (special tokens, ids past the
    tokenizer's), or a UTF-8 fragment (U+FFFD alone)."""
    out = []
    for i in range(vocab):
        text = tokenizer.decode([i])
        if not text or REPLACEMENT in text:
            out.append(i)
    return out


def mute_non_text_ids(model: torch.nn.Module, tokenizer: Tokenizer) -> list[int]:
    """Zero the lm_head rows of `non_text_ids` (the model must not tie them to the
    embeddings); returns those ids."""
    head = model.lm_head.weight
    if head.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        raise ValueError("lm_head is tied to the embeddings: muting would zero their rows too")
    muted = non_text_ids(tokenizer, head.shape[0])
    with torch.no_grad():
        head[muted] = 0
    return muted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(demo.PRESETS))
    ap.add_argument("--vocab", type=int, default=8192, help="must be >= the demo tokenizer's")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--text-ids-only",
        action="store_true",
        help="zero lm_head's rows of ids that decode to no text or a UTF-8 fragment on their "
        "own: greedy decoding streams one id per chunk on every server",
    )
    args = ap.parse_args()
    tok_dir = demo.ensure_demo_model()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    for f in tok_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, out / f.name)
    base = json.loads((tok_dir / "config.json").read_text())
    if args.vocab < base["vocab_size"]:
        ap.error(f"--vocab must be >= the demo tokenizer's {base['vocab_size']} ids")
    if args.vocab > base["vocab_size"]:  # fine for decode speed, useless for streamed text
        print(
            f"note: ids >= {base['vocab_size']} have no token and decode to no text on any "
            f"server; for HTTP workloads that time streamed text use --vocab {base['vocab_size']}",
            file=sys.stderr,
        )
    hf = dict(demo.DEMO_CONFIG, head_dim=None, **demo.PRESETS[args.preset])
    hf.update(
        vocab_size=args.vocab,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        torch_dtype=args.dtype,
        tie_word_embeddings=False,
    )
    hf = {k: v for k, v in hf.items() if v is not None}
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    dtype = getattr(torch, args.dtype)
    model = build_empty(ModelConfig.from_hf(hf), torch.device(args.device), dtype)
    demo.init_random_(model, demo.DEMO_SEED)
    if args.text_ids_only:
        muted = mute_non_text_ids(model, Tokenizer.from_dir(out))
        print(f"--text-ids-only: {len(muted)} of {args.vocab} ids muted", file=sys.stderr)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    n = sum(v.numel() for v in state.values())
    print(f"wrote {out}: {n / 1e9:.2f}B parameters, {n * dtype.itemsize / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
