#!/bin/bash
# Issue 10's next device sequence (after run K, session 38): does `triton-split` (a mixed
# step's decode rows in the decode kernel) pay, and do the GPU tests pass in full. Runs as
# the SEQ of bench/device_bg.sh, so that it outlives each 600 s call:
#   bash bench/device_bg.sh bench/h200_split_ab.sh 540 /tmp/ac /tmp/acj   (carry .whl .llama)
# and again at once after each call returns, until its log says "done" (~28 min in all on
# an H200: device time for one session; what matters most runs first).
# Writes under /tmp/res: kernels.log (bench/attn_kernels.py: the mixed-step table, one
# launch vs split, and the prefill launches with 3 stages), profile_{triton,triton-split}.log
# (the wave step), agents logs (ds4pool, ds4pool:split and llama-server at 32 / 64 agents,
# the two ds4pool runs traced: bench/trace_report.py TRACE --agents JSON),
# gpu_tests.log (pytest -m cuda tests/gpu with the 25 slowest tests).
set -u
R=${R:-/tmp/res}
mkdir -p "$R"
type step >/dev/null 2>&1 || step() { echo "== $* at $(date +%T)" >>"$R/seq.log"; }  # run alone
PHASE=prep bash bench/h200_agents.sh >$R/prep.log 2>&1 &
prep=$!
while [ ! -f /tmp/llama/converting ] && kill -0 $prep 2>/dev/null; do sleep 2; done
step kernels  # beside the build and the conversion: the GPU is otherwise idle
PYTHONPATH=/tmp/site timeout 400 python3 bench/attn_kernels.py >$R/kernels.log 2>&1
for b in triton triton-split; do
  step "profile $b"
  PYTHONPATH=/tmp/site timeout 200 python3 bench/profile_decode.py --model /tmp/m8b --batch 24 \
    --prompt-len 3000 --mixed 243 --mixed-ctx 2900 --mixed-chunks 1 8 --top 10 --backend $b \
    >$R/profile_$b.log 2>&1
done
wait $prep
for n in 32 64; do  # traced: the exposed host time before each step (admission, session 38)
  step "agents $n"
  SERVERS="ds4pool:tr$n ds4pool:split$n llama-server" AGENTS=$n PHASE=seq LIMIT=500 \
    VARIANTS="tr$n=--trace-steps $R/tr$n.jsonl;split$n=--attention-backend triton-split \
--trace-steps $R/split$n.jsonl" bash bench/h200_agents.sh >$R/agents$n.log 2>&1
done
step "gpu tests"
PYTHONPATH=/tmp/site timeout 1200 python3 -m pytest -m cuda tests/gpu -q -p no:cacheprovider \
  --durations=25 >$R/gpu_tests.log 2>&1
step "gpu tests rc $?"
step "agents 64, pauses 0.1-0.5 s"
THINK="0.1 0.5" AC=/tmp/acj OUT=/tmp/oj SERVERS="ds4pool ds4pool:split llama-server" AGENTS=64 \
  PHASE=seq LIMIT=500 VARIANTS="split=--attention-backend triton-split" bash bench/h200_agents.sh \
  >$R/agentsj64.log 2>&1
