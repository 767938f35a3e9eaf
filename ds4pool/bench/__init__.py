"""`ds4pool bench ...`: benchmarks that drive a running server over HTTP.

Only argparse wiring lives here; each action's module imports its client libraries
(openai, httpx, matplotlib) when it runs, so `ds4pool --help` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(sub: Any) -> None:
    """Register `bench` and its actions on the top-level subparsers."""
    from ds4pool.bench.agents import add_agents_args

    bench = sub.add_parser("bench", help="benchmarks against a running server")
    actions = bench.add_subparsers(dest="bench_command", required=True)
    agents = actions.add_parser(
        "agents",
        help="simulate N coding agents (growing multi-turn sessions) against a server",
        description="Simulate N coding agents against a running OpenAI-compatible server.",
    )
    add_agents_args(agents)
    agents.set_defaults(func=_cmd_agents)


def _cmd_agents(args: argparse.Namespace) -> int:
    from ds4pool.bench.agents import run_agents

    return run_agents(args)
