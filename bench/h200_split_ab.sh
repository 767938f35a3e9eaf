#!/bin/bash
# Issue 10's device sequence. Run L (session 39) and run M (session 41, an H100, at
# dd76b70: docs/BENCHMARKS.md) ran earlier versions of it. The next lease's, in order:
# - the GPU tests whose bf16 criteria session 41 restated (run M failed 3 of them by 5-10%
#   on the demo model's near-tied logits): test_fast_path_cuda.py, test_engine_cuda.py;
# - bench/gil_convoy.py on the 8B's eager wave step: how long its launches take beside a
#   thread tokenizing prompts as the API does, with the tokenizer call that holds the GIL
#   (ds4pool before session 41) and the one that does not, at 5 ms and 200 µs switch;
# - the agents at 64 / 32, traced: ds4pool now (encode without the GIL, 200 µs switch) and
#   ds4pool:before (dd76b70, exported to .before: run M's build) side by side — are the
#   first steps of each wave (run M: 130-346 ms for a shape that takes 40) gone (the trace
#   now says the launch call's CPU time: trace_report's slow steps), and what
#   does it do to the resumed TTFT? then the 200 µs switch alone (--gil-switch-us 5000) at 64.
# Runs as the SEQ of bench/device_bg.sh, so that it outlives each 600 s call:
#   rm -rf .before && mkdir .before && git archive dd76b70 ds4pool | tar -x -C .before
#   bash bench/device_bg.sh bench/h200_split_ab.sh 540 /tmp/ac   (carry .whl .llama .before)
# and again at once after each call returns, until its log says "done".
# Writes under /tmp/res: gpu_changed.log, convoy.log, agents logs (bench/trace_report.py
# TRACE --agents JSON for trN / beN), clocksN.csv.
set -u
# ~8 min before the GPU tests: no llama.cpp build (llama-server's figures at 32 / 64 agents
# on this workload are run K's, an H200)
. bench/device_prep.sh
step "gpu tests, changed"  # session 41: bf16 criteria against the fp32 reference
timeout 600 python3 -m pytest -m cuda -q -p no:cacheprovider --durations=10 \
  tests/gpu/test_fast_path_cuda.py tests/gpu/test_engine_cuda.py >$R/gpu_changed.log 2>&1
step "gpu tests, changed: rc $?"
step convoy  # ~3.6k-token prompts (the agents workload's size with this tokenizer)
timeout 300 python3 bench/gil_convoy.py --model /tmp/m8b --device cuda --dtype bfloat16 \
  --batch 24 --context 3000 --chunk 243 --threads 1 --prompt-tokens 700 --steps 5 \
  --intervals-us 5000 200 >$R/convoy.log 2>&1
for n in 64 32; do
  step "agents $n"
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw --format=csv -lms 50 \
    >$R/clocks$n.csv 2>&1 &
  smi=$!
  SERVERS="ds4pool:tr$n ds4pool:before" AGENTS=$n PHASE=seq LIMIT=300 BEFORE=.before \
    VARIANTS="tr$n=--trace-steps $R/tr$n.jsonl;before=--trace-steps $R/be$n.jsonl" \
    bash bench/h200_agents.sh >$R/agents$n.log 2>&1
  kill $smi 2>/dev/null
done
step "agents 64, 5 ms switch"
SERVERS="ds4pool:si64" AGENTS=64 PHASE=seq LIMIT=200 \
  VARIANTS="si64=--gil-switch-us 5000 --trace-steps $R/si64.jsonl" \
  bash bench/h200_agents.sh >$R/agents64si.log 2>&1
