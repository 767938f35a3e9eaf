#!/bin/bash
# The next lease's sequence (after session 43; runs R-T in docs/BENCHMARKS.md), in priority
# order:
# 1. `triton-small` (session 43, measured on no GPU yet): a mixed step's decode rows on
#    16-row tiles of the one prefill launch, where each is a 128-row tile with 4 live rows
#    today (run K: a one-chunk mixed graph's prefill kernel 9.0 ms a step, mostly its 24
#    decode rows; triton-split took it to 2.1 + 2.5 ms but costs a launch a layer and slowed
#    the waves' first steps, run T). bench/attn_kernels.py (its checks on the GPU, then the
#    mixed steps' table: one launch / split / small tiles, per layer, and their outputs'
#    largest difference); the wave and one-chunk steps through the runner
#    (profile_decode.py) with and without; the whole GPU suite (its new triton-small cases:
#    the warm-up covers it, its logits as close to fp32 as the one launch's, graphs too);
#    the agents at 64 then 32 agents, defaults against triton-small, two rounds, traced.
# 2. Nsight Compute on the prefill kernel (bench/attn_kernels.py --case): why a wave step's
#    8 chunks of 243 over ~2.9k run at ~236 TFLOP/s where a long prompt reaches 376-400.
# 3. ds4pool and llama-server at 16 agents, in step and out of step (run S did 32 / 64):
#    bench/h200_stagger.sh at NS=16.
# Runs as the SEQ of bench/device_bg.sh (carry .whl .llama):
#   bash bench/device_bg.sh bench/h200_next.sh 540 /tmp/ac /tmp/acs
# and again at once after each call returns, until its log says "done". Under /tmp/res:
# attn.txt, profile_*.txt, gpu_all.log, agents*.log and traces, ncu_*.txt.
set -u
. bench/device_prep.sh
step "attn_kernels"
timeout 400 python3 bench/attn_kernels.py >$R/attn.txt 2>&1
step "attn_kernels rc $?; profile, one launch then small tiles"
PROFILE=(python3 bench/profile_decode.py --model /tmp/m8b --batch 24 --prompt-len 3000
  --mixed 243 --mixed-ctx 2900 --mixed-chunks 1 8)
timeout 200 "${PROFILE[@]}" >$R/profile_one.txt 2>&1
timeout 200 "${PROFILE[@]}" --backend triton-small >$R/profile_small.txt 2>&1
step "gpu suite"
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 4 --dist loadfile)
timeout 600 python3 -m pytest -m cuda -q -p no:cacheprovider --durations=15 "${XDIST[@]}" \
  tests/gpu >$R/gpu_all.log 2>&1
step "gpu suite: rc $?"
for n in 64 32; do
  for r in a b; do
    step "agents $n, round $r"
    SERVERS="ds4pool:tr$n$r ds4pool:sm$n$r" AGENTS=$n PHASE=seq LIMIT=300 \
      VARIANTS="tr$n$r=--trace-steps $R/tr$n$r.jsonl;sm$n$r=--attention-backend triton-small --trace-steps $R/sm$n$r.jsonl" \
      bash bench/h200_agents.sh >$R/agents$n$r.log 2>&1
  done
done
NCU=(ncu --clock-control none -k regex:prefill_kernel --launch-skip 1 -c 1 --set full)
CASE=(python3 bench/attn_kernels.py --reps 3 --case)
for c in "wave 24,3000,8,243,3143 --split" "wave_one 24,3000,8,243,3143" "long 0,0,1,2048,16384"; do
  read -r name spec flag <<<"$c"
  step "ncu: $name"
  timeout 240 "${NCU[@]}" "${CASE[@]}" $spec ${flag:-} >$R/ncu_$name.txt 2>&1
done
NS=16 bash bench/h200_stagger.sh  # its steps in this sequence's log
