#!/bin/bash
# A long device sequence across several short device calls (the device tool stops a call at
# 600 s and hands the machine back after 30 s idle). The first call starts SEQ (a bash script
# of this repository: the runs, in priority order, writing what should come back under
# /tmp/res) in the background, outside the call; every call, the first included, waits up to
# WAIT seconds or until SEQ has ended, prints SEQ's log (/tmp/res/seq.log: one line per step
# from `step`), and packs /tmp/res plus any EXTRA directories into $OUT/res.tgz. Make the
# next call at once when one returns, with WAIT sized to the device time left.
#   bash bench/device_bg.sh SEQ [WAIT=540] [EXTRA...]
# SEQ sees `step "what"` (appends a timestamped line to the log) and R=/tmp/res. Session 38
# (run K, docs/BENCHMARKS.md) ran the prep, the profile, five agents comparisons and the GPU
# tests this way in four calls, with the GPU busy between them.
set -u
SEQ=${1:?usage: bench/device_bg.sh SEQ [WAIT] [EXTRA...]}
WAIT=${2:-540}
shift $(($# < 2 ? $# : 2))
R=/tmp/res
if [ ! -f $R/seq.log ]; then
  mkdir -p $R
  echo "== start $(date +%T) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" \
    >$R/seq.log
  R=$R setsid nohup bash -c 'step() { echo "== $* at $(date +%T) (${SECONDS} s)" >>"$R/seq.log"; }
    export -f step; export PYTHONUNBUFFERED=1; bash "$0"; step "done rc $?"; touch "$R/done"' \
    "$SEQ" >$R/nohup.log 2>&1 </dev/null &
  sleep 2
fi
end=$((SECONDS + WAIT))
while [ $SECONDS -lt $end ] && [ ! -f $R/done ]; do sleep 3; done
cat $R/seq.log
[ -f $R/done ] || echo "(still running)"
tar czf "$OUT/res.tgz" -C / tmp/res "${@#/}" 2>/dev/null
ls -la "$OUT"
