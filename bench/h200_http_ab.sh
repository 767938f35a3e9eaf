#!/bin/bash
# The agents workload at 64 agents (bench/h200_agents.sh: 8B-shaped, 4 turns, S=2400, U=230,
# G=64, 0.2 s pauses), ds4pool with uvicorn on h11 + asyncio (before session 42) against its
# new default, httptools + uvloop (bench/http_cost.py: the event loop's CPU 0.72x per request and
# 0.63x per streamed chunk on CPU), both traced. Runs as the SEQ of bench/device_bg.sh, with the
# httptools and uvloop wheels among the carried .whl:
#   bash bench/device_bg.sh bench/h200_http_ab.sh 540     (carry .whl)
set -u
. bench/device_prep.sh
step "agents 64"
SERVERS="ds4pool:h11 ds4pool:uv" AGENTS=64 PHASE=seq LIMIT=420 \
  VARIANTS="h11=--http h11 --loop asyncio --trace-steps $R/h11.jsonl;uv=--trace-steps $R/uv.jsonl" \
  bash bench/h200_agents.sh >$R/agents64.log 2>&1
