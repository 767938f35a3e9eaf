#!/bin/bash
# The next lease's sequence (after session 43; runs R-T in docs/BENCHMARKS.md), in priority
# order:
# - why a wave step's prompt attention runs at ~236 TFLOP/s where a long prompt's reaches
#   376-400 (run L): Nsight Compute (`--set full`: throughput, occupancy, warp stalls, memory
#   chart, as text) on one launch of the prefill kernel for the agents' wave step's 8 chunks
#   of 243 tokens over ~2.9k (as triton-split runs it: the chunks alone), the same step in
#   one launch with its 24 decode rows (the default), and a 2,048-token chunk over 16k for
#   contrast (bench/attn_kernels.py --case). The one lever left for the in-step resumed-turn TTFT at 32 agents (run
#   S's bound: prompt attention ~1.7x slower than its best in wave steps);
# - ds4pool and llama-server at 16 agents, in step and out of step (run S measured 32 / 64).
# Runs as the SEQ of bench/device_bg.sh (carry .whl .llama):
#   bash bench/device_bg.sh bench/h200_next.sh 540 /tmp/ac /tmp/acs
# and again at once after each call returns, until its log says "done". Under /tmp/res:
# ncu_*.txt, the agents logs and traces.
set -u
. bench/device_prep.sh
NCU=(ncu --clock-control none -k regex:prefill_kernel --launch-skip 1 -c 1 --set full)
CASE=(python3 bench/attn_kernels.py --reps 3 --case)
for c in "wave 24,3000,8,243,3143 --split" "wave_one 24,3000,8,243,3143" "long 0,0,1,2048,16384"; do
  read -r name spec flag <<<"$c"
  step "ncu: $name"
  timeout 240 "${NCU[@]}" "${CASE[@]}" $spec ${flag:-} >$R/ncu_$name.txt 2>&1
done
step "llama.cpp build"
PHASE=prep SERVERS=llama-server bash bench/h200_agents.sh >$R/prep.log 2>&1
step "agents 16, pause 0.2 s"
SERVERS="ds4pool:lk16 llama-server" AGENTS=16 PHASE=seq LIMIT=900 \
  VARIANTS="lk16=--trace-steps $R/lk16.jsonl" bash bench/h200_agents.sh >$R/lock16.log 2>&1
step "agents 16, pause 0.1-2.0 s"
THINK="0.1 2.0" AC=/tmp/acs OUT=$OUT/stag SERVERS="ds4pool:st16 llama-server" AGENTS=16 \
  PHASE=seq LIMIT=900 VARIANTS="st16=--trace-steps $R/st16.jsonl" bash bench/h200_agents.sh \
  >$R/stag16.log 2>&1
