"""`ds4pool generate`: completion text on stdout, timings on stderr."""

from __future__ import annotations

import argparse
import sys

from ds4pool.errors import Ds4poolError
from ds4pool.generate import generate
from ds4pool.kv.blocks import BlockPool
from ds4pool.model.device import select_device, select_dtype
from ds4pool.model.loader import load_model
from ds4pool.model.runner import ModelRunner
from ds4pool.model.sampler import SamplingParams


def run_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise Ds4poolError("--max-tokens must be >= 1")
    if args.kv_block_size < 1 or args.chunk_size < 1:
        raise Ds4poolError("--kv-block-size and --chunk-size must be >= 1")
    try:
        sampling = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
        )
    except ValueError as exc:
        raise Ds4poolError(str(exc)) from None
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    device = select_device(args.device)
    dtype = select_dtype(args.dtype, device)
    loaded = load_model(
        args.model,
        device,
        dtype,
        show_progress=sys.stderr.isatty(),
        tokenizer_dir=args.tokenizer,
    )
    tok = loaded.tokenizer
    if args.chat:
        messages = [{"role": "user", "content": prompt}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    else:
        ids = tok.encode(prompt)
    needed = min(len(ids) + args.max_tokens, loaded.config.max_position)
    num_blocks = -(-needed // args.kv_block_size) + 1
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=args.kv_block_size)
    [result] = generate(
        runner,
        BlockPool(num_blocks),
        [ids],
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop_token_ids=tok.eos_token_ids,
        chunk_size=args.chunk_size,
    )
    sys.stdout.write(tok.decode(result.token_ids))
    sys.stdout.write("\n")
    sys.stdout.flush()
    n_out = len(result.token_ids)
    prefill_rate = len(ids) / max(result.prefill_seconds, 1e-9)
    decode_rate = max(n_out - 1, 0) / max(result.decode_seconds, 1e-9)
    print(
        f"[{loaded.name} on {device} {str(dtype).removeprefix('torch.')}] "
        f"prefill: {len(ids)} tokens in {result.prefill_seconds:.3f}s "
        f"({prefill_rate:.1f} tok/s); decode: {n_out} tokens in {result.decode_seconds:.3f}s "
        f"({decode_rate:.1f} tok/s); finish: {result.finish_reason}",
        file=sys.stderr,
    )
    return 0
