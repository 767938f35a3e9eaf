#!/bin/bash
# Issue 10's next device sequence (after run K, session 38): does `triton-split` (a mixed
# step's decode rows in the decode kernel) pay, and do the GPU tests pass in full. Runs as
# the SEQ of bench/device_bg.sh, so that it outlives each 600 s call:
#   bash bench/device_bg.sh bench/h200_split_ab.sh 540 /tmp/ac /tmp/acj   (carry .whl .llama)
# and again at once after each call returns, until its log says "done" (what matters most
# runs first).
# Writes under /tmp/res: kernels.log (bench/attn_kernels.py: the mixed-step table, one
# launch vs split, and the prefill launches with 3 stages), profile_{triton,triton-split}.log
# (the wave step, its timeline's gaps; chrome traces in trace_*/), gpu_new.log (the GPU
# tests added in session 38), agents logs (ds4pool and ds4pool:split at 64 / 32 agents,
# traced: bench/trace_report.py TRACE --agents JSON), gpu_tests.log (pytest -m cuda
# tests/gpu with the 25 slowest tests).
set -u
R=${R:-/tmp/res}
mkdir -p "$R"
type step >/dev/null 2>&1 || step() { echo "== $* at $(date +%T)" >>"$R/seq.log"; }  # run alone
# The order fits ~20 min of a lease: what decides triton-split first, then the agents without
# llama-server (its figures at 32 / 64 agents are run K's, same workload, an H200: no llama.cpp
# build), the rest of the GPU tests last.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
step model
[ -f /tmp/m8b/config.json ] || python3 bench/write_random_model.py --preset llama3-8b \
  --vocab 1024 /tmp/m8b --device cuda --text-ids-only >$R/model.log 2>&1
step kernels
timeout 300 python3 bench/attn_kernels.py >$R/kernels.log 2>&1
mkdir -p $R/trace
for b in triton triton-split; do
  step "profile $b"
  timeout 200 python3 bench/profile_decode.py --model /tmp/m8b --batch 24 --prompt-len 3000 \
    --mixed 243 --mixed-ctx 2900 --mixed-chunks 1 8 --top 10 --backend $b --trace $R/trace \
    >$R/profile_$b.log 2>&1
  gzip -f $R/trace/*.json && mkdir -p $R/trace_$b && mv $R/trace/*.gz $R/trace_$b/
done
step "gpu tests: the ones not run before"
timeout 300 python3 -m pytest -m cuda tests/gpu/test_fast_path_cuda.py \
  tests/gpu/test_overlap_cuda.py -q -p no:cacheprovider --durations=10 >$R/gpu_new.log 2>&1
step "gpu new rc $?"
for n in 64 32; do  # traced: the exposed host time before each step (admission, session 38)
  step "agents $n"
  SERVERS="ds4pool:tr$n ds4pool:split$n" AGENTS=$n PHASE=seq LIMIT=400 \
    VARIANTS="tr$n=--trace-steps $R/tr$n.jsonl;split$n=--attention-backend triton-split \
--trace-steps $R/split$n.jsonl" bash bench/h200_agents.sh >$R/agents$n.log 2>&1
done
step "gpu tests, all"
timeout 1200 python3 -m pytest -m cuda tests/gpu -q -p no:cacheprovider --durations=25 \
  >$R/gpu_tests.log 2>&1
step "gpu tests rc $?"
