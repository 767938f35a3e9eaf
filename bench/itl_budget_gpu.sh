#!/bin/bash
# --itl-budget-factor on the H200, one device call (~9 min): bench/sched.py part 2 (a 16k
# prompt next to 8 decoders, default work cap 896) with the factor off / 2 / 2.5 / 3, then
# the 32-agent workload (ds4pool bench agents, the server of docs/BENCHMARKS.md run D) with
# the factor off vs 2.5, for the tok/s and resumed-turn cost.
#   run from the repository root, with the server stack importable (the device image lacks
#   lz4 / cachetools / the HTTP stack: install the wheels as the session scripts do, e.g.
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site:$PWD)
# Results: $OUT/sched_itl.log (table) and $OUT/ag-*.log (+ the agents' JSON).
# PARTS="tests sched" / PARTS=agents splits it over two calls if one runs past 10 minutes.
set -u
OUT=${OUT:-/tmp/itl_budget}
PARTS=${PARTS:-"tests sched agents"}
want() { [[ " $PARTS " == *" $1 "* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# the factor is on by default on CUDA: the graphs-ahead test's 16k prefill next to decoders
# must still replay graphs only (smaller chunks, the same buckets)
if want tests; then
  timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE \
    tests/gpu/test_graphs_ahead_cuda.py > "$OUT/graphs_ahead_tests.log" 2>&1
  tail -2 "$OUT/graphs_ahead_tests.log"; echo "tests at $SECONDS s"
fi
if want sched; then
  timeout 300 python3 bench/sched.py --model random:llama3-8b --device cuda --dtype bfloat16 \
    --parts 2 --max-prefill-tokens 512 --max-prefill-cost 896 \
    --itl-budget-factor 0 2 2.5 3 0 2.5 --no-baselines > "$OUT/sched_itl.log" 2>&1
  grep -E "^\|" "$OUT/sched_itl.log"; echo "sched at $SECONDS s"
fi
want agents || exit 0

python3 bench/write_random_model.py --preset llama3-8b --vocab 1024 /tmp/m8b --device cuda \
  > /tmp/write.log 2>&1; tail -1 /tmp/write.log
W="--turns 4 --system-tokens 2400 --user-tokens 230 --gen-tokens 64 --think-s 0.2 0.2 --seed 0 --timeout-s 120"
wait_up() { for _ in $(seq 1 240); do curl -sf -m 2 "http://127.0.0.1:$1/v1/models" >/dev/null && return 0; sleep 0.5; done; return 1; }
run() {  # label agents server-args...
  local label=$1 n=$2; shift 2
  [ "$SECONDS" -gt 500 ] && { echo "no time for $label"; return; }
  python3 -m ds4pool serve --model /tmp/m8b --port 8100 "$@" > "/tmp/$label.server.log" 2>&1 &
  local pid=$!
  if wait_up 8100; then
    # shellcheck disable=SC2086  # W is a list of flags
    timeout $((585 - SECONDS)) python3 -m ds4pool bench agents --url http://127.0.0.1:8100 \
      --agents "$n" $W --out /tmp/ag --label "$label" > "$OUT/$label.log" 2>&1
    tail -4 "$OUT/$label.log" | head -3 | tail -1
    curl -s http://127.0.0.1:8100/metrics | grep -E "^ds4pool_prefill_(work_budget_(sum|count)|seconds_per_work)" | tr '\n' ' '; echo
  else echo "$label: server did not come up"; tail -5 "/tmp/$label.server.log"; fi
  kill "$pid"; wait "$pid" 2>/dev/null; echo "$label done at $SECONDS s"
}
run ag-N32-f0 32 --itl-budget-factor 0
run ag-N32-f2.5 32 --itl-budget-factor 2.5
cp /tmp/ag/*.json "$OUT/" 2>/dev/null
echo "end at $SECONDS s"
