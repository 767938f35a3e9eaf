"""Command line: `ds4pool generate ...` (more subcommands arrive with the server).

User errors print one line on stderr and exit with status 1 (2 for bad usage);
never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ds4pool import __version__
from ds4pool.allocator import fix_mmap_threshold
from ds4pool.errors import Ds4poolError
from ds4pool.threads import apply_thread_env


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="demo",
        help="'demo' (default), 'random:PRESET' (100m, llama3-8b, qwen3-moe-70m, "
        "qwen3-30b-a3b), a local HF model dir, or 'scripted:RULES.json'",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer directory for random:* and scripted:* models",
    )
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda[:N], mps")
    p.add_argument(
        "--dtype", default="auto", help="auto, float32, bfloat16, float16 (auto: bf16 on CUDA)"
    )
    p.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ds4pool", description=__doc__)
    parser.add_argument("--version", action="version", version=f"ds4pool {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one prompt and print the text")
    _add_model_args(gen)
    gen.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message")
    gen.add_argument("--system", default=None, help="system message (with --chat)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chunk-size", type=int, default=512, help="prefill chunk in tokens")
    gen.set_defaults(func=_cmd_generate)

    from ds4pool.serve import add_engine_flags, add_server_flags

    serve = sub.add_parser("serve", help="run the OpenAI/Anthropic-compatible HTTP server")
    add_engine_flags(serve)
    add_server_flags(serve)
    serve.set_defaults(func=_cmd_serve)

    from ds4pool.sessions_cli import add_sessions_parser

    add_sessions_parser(sub)

    from ds4pool.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from ds4pool.generate_cli import run_generate

    return run_generate(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from ds4pool.serve import run_serve

    return run_serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    apply_thread_env(os.environ)  # before any subcommand imports torch
    fix_mmap_threshold(os.environ)  # session buffers handed back to the kernel when freed
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except Ds4poolError as exc:
        print(f"ds4pool: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ds4pool: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
