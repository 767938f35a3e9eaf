#!/bin/bash
# ds4pool against llama-server (CUDA) in one lease at the current build, on the issue's
# lockstep workload (every agent pauses exactly 0.2 s, so their resumed turns arrive as one
# wave) and on one whose pauses are drawn from 0.1-2.0 s (agents out of step), in priority
# order: 64 agents lockstep, 64 out of step, 32 lockstep, 32 out of step (NS="64 32": the
# agent counts, in that order). Run K (session 38,
# an H200) is the last time both servers ran side by side; since then ds4pool's figures came
# from ds4pool-only leases. Runs as the SEQ of bench/device_bg.sh (carry .whl .llama):
#   bash bench/device_bg.sh bench/h200_stagger.sh 540 /tmp/ac /tmp/acs
# and again at once after each call returns, until its log says "done". The llama.cpp
# build (~4 min on 16 cores) runs while nothing is measured. Run S in docs/BENCHMARKS.md
# (session 43, an H100): resumed turns 1.7x / 3.4x later than llama-server's in step, 4.0x /
# 3.5x sooner out of step, at 32 / 64 agents.
set -u
NS=${NS:-"64 32"}
. bench/device_prep.sh
step "llama.cpp build and GGUF"
PHASE=prep SERVERS=llama-server bash bench/h200_agents.sh >$R/prep.log 2>&1
for n in $NS; do
  step "agents $n, pause 0.2 s"
  SERVERS="ds4pool:lk$n llama-server" AGENTS=$n PHASE=seq LIMIT=900 \
    VARIANTS="lk$n=--trace-steps $R/lk$n.jsonl" bash bench/h200_agents.sh >$R/lock$n.log 2>&1
  step "agents $n, pause 0.1-2.0 s"
  THINK="0.1 2.0" AC=/tmp/acs OUT=$OUT/stag SERVERS="ds4pool:st$n llama-server" AGENTS=$n \
    PHASE=seq LIMIT=900 VARIANTS="st$n=--trace-steps $R/st$n.jsonl" bash bench/h200_agents.sh \
    >$R/stag$n.log 2>&1
done
