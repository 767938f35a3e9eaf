#!/bin/bash
# Issue 10's device sequence. Run L (session 39, docs/BENCHMARKS.md) ran it at e44cce4:
# triton-split measured (stays opt-in), the wave step's timeline, the 3-stage prefill
# launches. The next lease's, in order:
# - the GPU tests of session 40's changes (the eager warm-up: no Triton compile while
#   serving; the prefill and MLA kernels' keys; several-chunk mixed graphs equal to eager);
# - the attention kernels; the wave step's profile with the prefill launch Hopper gets since
#   session 39 (DEEP_PREFILL) against the old one, and replayed as a graph (--graph-chunks 8)
#   against eager;
# - the agents at 64 / 32, traced, with and without --graph-chunks 8 (the servers now start
#   with the eager warm-up: run L's 0.3-1.2 s steps gone? trace_report's slow steps; the
#   admission change's host time before a wave, against run L's trace; llama-server's
#   figures are run K's);
# - the GPU tests in full.
# Runs as the SEQ of bench/device_bg.sh, so that it outlives each 600 s call:
#   bash bench/device_bg.sh bench/h200_split_ab.sh 540 /tmp/ac   (carry .whl .llama)
# and again at once after each call returns, until its log says "done".
# Writes under /tmp/res: gpu_changed.log, kernels.log (bench/attn_kernels.py),
# profile_{default,deep,gc}.log (the wave step, its timeline's gaps; chrome traces in
# trace_*/), agents logs (ds4pool at 64 / 32 agents, traced: bench/trace_report.py TRACE
# --agents JSON), clocksN.csv, gpu_tests.log (pytest -m cuda tests/gpu, the 25 slowest).
set -u
R=${R:-/tmp/res}
mkdir -p "$R"
type step >/dev/null 2>&1 || step() { echo "== $* at $(date +%T)" >>"$R/seq.log"; }  # run alone
# ~8 min before the GPU tests: no llama.cpp build (llama-server's figures at 32 / 64 agents
# on this workload are run K's, an H200)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site
step model
[ -f /tmp/m8b/config.json ] || python3 bench/write_random_model.py --preset llama3-8b \
  --vocab 1024 /tmp/m8b --device cuda --text-ids-only >$R/model.log 2>&1
step "gpu tests, changed"  # session 40: the eager warm-up, the prefill / MLA kernels' keys
timeout 600 python3 -m pytest -m cuda -q -p no:cacheprovider --durations=10 \
  tests/gpu/test_warm_up_cuda.py tests/gpu/test_mla_cuda.py \
  tests/gpu/test_triton_attention_cuda.py tests/gpu/test_graphs_ahead_cuda.py \
  >$R/gpu_changed.log 2>&1
step "gpu tests, changed: rc $?"
step kernels
timeout 300 python3 bench/attn_kernels.py >$R/kernels.log 2>&1
mkdir -p $R/trace
for pl in default deep; do  # the prefill launch, side by side (fabbba6 made deep Hopper's)
  step "profile $pl"
  timeout 200 python3 bench/profile_decode.py --model /tmp/m8b --batch 24 --prompt-len 3000 \
    --mixed 243 --mixed-ctx 2900 --mixed-chunks 1 8 --top 10 --prefill-launch $pl \
    --trace $R/trace >$R/profile_$pl.log 2>&1
  gzip -f $R/trace/*.json && mkdir -p $R/trace_$pl && mv $R/trace/*.gz $R/trace_$pl/
done
step "profile graph-chunks"  # session 40: the 8-chunk wave step as a graph replay
timeout 200 python3 bench/profile_decode.py --model /tmp/m8b --batch 24 --prompt-len 3000 \
  --mixed 243 --mixed-ctx 2900 --mixed-chunks 1 8 --top 10 --graph-chunks 8 \
  --graph-chunk-tokens 2048 --trace $R/trace >$R/profile_gc.log 2>&1
gzip -f $R/trace/*.json && mkdir -p $R/trace_gc && mv $R/trace/*.gz $R/trace_gc/
for n in 64 32; do  # traced: the host time before each step (admission, 6bf6a75)
  step "agents $n"
  # the SM clock every 50 ms: run L's first step after a ~0.6 s idle took 155-296 ms where
  # the same shape took 40 (the clocks dropping while idle? trace_report's slow steps)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw --format=csv -lms 50 \
    >$R/clocks$n.csv 2>&1 &
  smi=$!
  SERVERS="ds4pool:tr$n ds4pool:gc$n" AGENTS=$n PHASE=seq LIMIT=300 \
    VARIANTS="tr$n=--trace-steps $R/tr$n.jsonl;gc$n=--graph-chunks 8 --trace-steps $R/gc$n.jsonl" \
    bash bench/h200_agents.sh >$R/agents$n.log 2>&1
  kill $smi 2>/dev/null
done
step "gpu tests, all"
timeout 1200 python3 -m pytest -m cuda tests/gpu -q -p no:cacheprovider --durations=25 \
  >$R/gpu_tests.log 2>&1
step "gpu tests rc $?"
