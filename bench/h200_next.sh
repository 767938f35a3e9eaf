#!/bin/bash
# Session 43's first sequence (run R in docs/BENCHMARKS.md: 210 GPU tests passed in 217 s;
# the graph-chunks A/B within the rounds' spread), in priority order:
# - the whole GPU suite (`pytest -m cuda tests/gpu`, ~13 min on an H100 in one process): not
#   run whole since run M (204 passed, 3 failed; the 3 restated in 23cee2c passed in run N
#   with the rest of their two files). Four pytest-xdist workers, a file each (its module
#   fixtures stay in one process), where .whl carries pytest-xdist and execnet: most of the
#   suite's time is Triton compiling on one core, and the machine has 16;
# - the agents workload (bench/h200_agents.sh: 8B-shaped, 4 turns, S=2400, U=230, G=64, 0.2 s
#   pauses) at 64 then 32 agents, two rounds each alternating, traced: the defaults (uvicorn
#   on httptools + uvloop since b890cb3) against `--graph-chunks 8`, whose 2-7-chunk steps
#   (the waves' first steps: 3-5x their median in runs M and N, a third of their launch
#   taking the GIL back under py-spy in run O) replay a graph, one GIL hand-over instead of
#   ~160 Triton launches' and ~130 torch calls' (run Q). Run M had it 18% sooner at 64 and
#   17% later at 32, one round each.
# Runs as the SEQ of bench/device_bg.sh, so that it outlives each 600 s call:
#   bash bench/device_bg.sh bench/h200_next.sh 540 /tmp/ac      (carry .whl)
# and again at once after each call returns, until its log says "done". Under /tmp/res:
# gpu_all.log, agentsN*.log, the step traces (bench/trace_report.py TRACE --agents JSON).
set -u
. bench/device_prep.sh
step "gpu suite"
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 4 --dist loadfile)
timeout 960 python3 -m pytest -m cuda -q -p no:cacheprovider --durations=25 "${XDIST[@]}" \
  tests/gpu >$R/gpu_all.log 2>&1
step "gpu suite: rc $?"
for n in 64 32; do
  for r in a b; do
    step "agents $n, round $r"
    SERVERS="ds4pool:tr$n$r ds4pool:gc$n$r" AGENTS=$n PHASE=seq LIMIT=300 \
      VARIANTS="tr$n$r=--trace-steps $R/tr$n$r.jsonl;gc$n$r=--graph-chunks 8 --trace-steps $R/gc$n$r.jsonl" \
      bash bench/h200_agents.sh >$R/agents$n$r.log 2>&1
  done
done
