#!/bin/bash
# What the step thread waits for in its slow launches at 64 agents (runs M and N: the first
# eager steps of each wave took 104-346 ms for shapes that take ~28-40, the launch call the
# whole of it, its CPU time ~50 ms): the server runs under py-spy (native stacks of every
# thread, 200 samples/s, a chrome trace) with --trace-steps, against the agents workload of
# bench/h200_agents.sh (8B-shaped, 4 turns, S=2400, U=230, G=64, 0.2 s pauses, one round);
# bench/pyspy_steps.py then says, for each eager launch of 60 ms or more, the step thread's
# time taking the GIL back / in the CUDA driver / running, and what the other threads ran.
# Runs as the SEQ of bench/device_bg.sh, with the py-spy wheel among the carried .whl:
#   bash bench/device_bg.sh bench/h200_probe.sh 540     (carry .whl)
# Writes under /tmp/res: probeN.txt (pyspy_steps), traceN.txt (trace_report), the agents
# JSON and the step trace; the chrome trace itself (~100s of MB) stays on the machine.
set -u
N=${N:-64}
RATE=${RATE:-200}  # samples/s: run O's 200 slowed the server ~3.5x (py-spy stops it each time)
. bench/device_prep.sh
port=8311
step "server under py-spy"
/tmp/site/bin/py-spy record --threads --idle --native --rate "$RATE" --format chrometrace \
  -o /tmp/ct$N.json -- python3 -m ds4pool serve --model /tmp/m8b --device cuda \
  --dtype bfloat16 --kv-device-gb 40 --max-batch-tokens 2048 --host 127.0.0.1 --port $port \
  --log-level warning --trace-steps $R/pr$N.jsonl >$R/server$N.log 2>&1 &
spy=$!
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null && break; sleep 1; done
server=$(pgrep -f "^python3 -m ds4pool serve" | head -1)
step "agents $N (server $server)"
python3 -m ds4pool bench agents --url "http://127.0.0.1:$port" --agents $N --turns 4 \
  --system-tokens 2400 --user-tokens 230 --gen-tokens 64 --think-s 0.2 0.2 --seed 0 \
  --client-procs 4 --out $R --label pr$N >$R/agents_pr$N.log 2>&1
kill -TERM "$server"
wait $spy
step "analyse ($(du -h /tmp/ct$N.json | cut -f1))"
python3 bench/pyspy_steps.py /tmp/ct$N.json $R/pr$N.jsonl --min-ms 60 --out $R/probe$N.json \
  >$R/probe$N.txt 2>&1
python3 bench/trace_report.py $R/pr$N.jsonl --agents $R/pr$N.json >$R/trace$N.txt 2>&1
