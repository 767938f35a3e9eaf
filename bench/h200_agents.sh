#!/bin/bash
# The multi-agent comparison on the H200 (issue 10): ds4pool, llama-server with CUDA and
# transformers serve on one 8B-shaped model, 16 / 32 / 64 agents, in two device calls.
#   PHASE=prep  (~6-7 min): start llama.cpp's CUDA build (in the background, setsid, so it
#               outlives the call), write the model (vocab 1024: every id decodes to text),
#               convert it to GGUF, wait for the build. The model's lm_head rows of ids that
#               stream no text alone are zero (--text-ids-only), so that every server streams
#               one token per chunk and ITL is per token everywhere (session 31).
#   PHASE=run   (the next call, within the machine's 30 s warm time, or prep runs again):
#               each server alone, one after the other, nothing else on the host.
#   PHASE=one   (one call, for when device time is short): the build and the conversion on
#               all cores but four (taskset), every server and its client on those four;
#               ds4pool runs while llama.cpp builds, llama-server after. The measured side
#               then shares the host's memory and disk, not its cores, with the build.
#   PHASE=seq   (one call, less time still): the build on all cores while the model is
#               written and converted, then for each N every server in turn, nothing beside
#               them (the N-loop outside: the smallest N of every server comes back first).
# Lessons of session 30 (docs/BENCHMARKS.md "Multi-agent workload on the H200", run E):
# - nothing may run beside a measured server: the build (16 cores, even at nice 19) and the
#   conversion beside ds4pool cut its tok/s to ~0.57x and bunched its streamed tokens (ITL
#   p50 0.3 ms at 32 agents: the client read several tokens at once);
# - llama-server's host prompt cache (--cache-ram, 8 GiB by default) thrashed at -np 32:
#   457 evictions of ~350 MB, serialised, stalled its slots for seconds (resumed turns 36 and
#   110 s): it runs here with --cache-ram 0 (its slots keep their KV anyway).
# - (run F) a fresh server's first prompts compile Triton kernels: in a ~7 s run that cost
#   ds4pool 0.67x its tok/s at 16 agents; `ds4pool bench agents` now warms every server up
#   with min(agents, 4) first turns of the workload's size before its clock starts.
# Run from the repository root with the wheels of the server stack and of transformers
# serve in .whl (the device image lacks them: see the device README) and the packed
# llama.cpp sources in .llama/llama_src.tgz (../shared/peers/pack_llama_src.sh); carry both.
# Results: $OUT/<server>-<N>.tgz (agents_compare.md / .json, the server log), and $OUT/all:
# every run of the machine's /tmp/ac in one table with the target lines at every N
# (`bench/agents_compare.py --merge`). Any SERVERS of agents_compare.py may be listed
# (no-batching too: one request at a time, so ~2-3 min at 64 agents on an H100).
# Runs on an H100 as well (sm_90, 80 GB: the 14 GB model and 40 GB of KV fit). Run I
# (session 35) measured the defaults at 16 / 32 / 64 agents with four client processes and
# traced ds4pool's resumed turns (bench/trace_report.py); its fixes after the trace (settle
# before an eager launch, prompts waiting for a shared prefix being computed) were measured
# alone at 32 agents in run J (session 36: push 2 ms, first turns 3.4x sooner, resumed p50
# 168 ms as agents line up more), not beside llama-server yet. The next call, after a prep
# call (one trace file per server and N: request
# ids restart with each server):
#   for n in 32 64 16; do SERVERS="ds4pool:tr$n llama-server" AGENTS=$n PHASE=seq LIMIT=180 \
#     VARIANTS="tr$n=--trace-steps /tmp/tr$n.jsonl" bash bench/h200_agents.sh; done
# then `python3 bench/trace_report.py /tmp/trN.jsonl --agents <its ds4pool JSON>` (its busy
# periods show the waves the agents arrive in). The same with pauses that vary (agents that
# do not stay in step): THINK="0.1 0.5" AC=/tmp/acj OUT=/tmp/oj before the same line. Run K
# (session 38, an H200) ran exactly these at 16 / 32 / 64 (docs/BENCHMARKS.md); run L
# (session 39) the mixed steps' decode rows in the decode kernel beside the default:
# SERVERS="ds4pool:trN ds4pool:splitN" VARIANTS="splitN=--attention-backend triton-split". All three
# servers, each N: SERVERS="ds4pool llama-server transformers" PHASE=run bash bench/h200_agents.sh
set -u
PHASE=${PHASE:-run}
SERVERS=${SERVERS:-"ds4pool llama-server transformers"}
# ds4pool variants for SERVERS' ds4pool:NAME entries, ";"-separated NAME=FLAGS, e.g.
# VARIANTS="b1=--prefill-burst 1;cap1280=--max-prefill-cost 1280"
VARIANTS=${VARIANTS:-}
VARIANT_ARGS=()
IFS=';' read -ra _variants <<<"$VARIANTS"
for v in "${_variants[@]}"; do [ -n "$v" ] && VARIANT_ARGS+=(--variant "$v"); done
AGENTS=${AGENTS:-"16 32 64"}
OUT=${OUT:-/tmp/h200_agents}
THINK=${THINK:-"0.2 0.2"}  # an agent's pause between turns, MIN MAX seconds (uniform)
AC=${AC:-/tmp/ac}  # the runs' directories (another AC for another workload: --merge takes all)
LIMIT=${LIMIT:-570}  # seconds: stop starting runs after this, so that the results come back
mkdir -p "$OUT" "$AC"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
SRC=/tmp/llama/src
# four client processes: one parsing ~1,700 streamed tokens/s was most of a core (run H)
WORK=(--client-procs 4 --model-dir /tmp/m8b --device cuda --kv-gb 40 --turns 4
  --system-tokens 2400 --user-tokens 230 --gen-tokens 64 --think-s $THINK)
NCPU=$(nproc)
BPIN="" JOBS=$NCPU PIN=()
if [ "$PHASE" = one ]; then  # the measured side on the last four cores, the build elsewhere
  BPIN="taskset -c 0-$((NCPU - 5))" JOBS=$((NCPU - 4)) PIN=(taskset -c "$((NCPU - 4))-$((NCPU - 1))")
fi

llama=0  # llama.cpp is built and the model converted only where llama-server is wanted
[ "$PHASE" = prep ] || [[ " $SERVERS " == *" llama-server "* ]] && llama=1
if [ "$llama" = 1 ] && [ ! -f /tmp/llama/started ]; then
  mkdir -p "$SRC" && touch /tmp/llama/started && tar xzf .llama/llama_src.tgz -C "$SRC"
  setsid nohup bash -c "cd $SRC && $BPIN cmake -B b -G Ninja -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
    -DCMAKE_BUILD_TYPE=Release >/tmp/llama/build.log 2>&1 &&
    $BPIN cmake --build b -j$JOBS --target llama-server >>/tmp/llama/build.log 2>&1; echo \$? >/tmp/llama/rc" \
    >/dev/null 2>&1 </dev/null &
fi
[ -f /tmp/m8b/config.json ] ||
  python3 bench/write_random_model.py --preset llama3-8b --vocab 1024 /tmp/m8b --device cuda \
    --text-ids-only
convert() {
  # a locally trained byte-level BPE has a pre-tokenizer hash the converter does not know:
  # "gpt-2" is the byte-level split regex (../shared/peers/llama_cpp_cuda.sh)
  $BPIN python3 - "$SRC" /tmp/m8b /tmp/m8b.gguf.part <<'PY' 2>&1 | grep -v Writing | tail -2
import runpy, sys
lc, hf, out = sys.argv[1:4]
sys.path.insert(0, lc); sys.path.insert(1, lc + "/gguf-py")
import conversion.base as b
b.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = [lc + "/convert_hf_to_gguf.py", hf, "--outtype", "bf16", "--outfile", out]
runpy.run_path(lc + "/convert_hf_to_gguf.py", run_name="__main__")
PY
  mv /tmp/m8b.gguf.part /tmp/m8b.gguf
}
if [ "$llama" = 1 ] && [ ! -f /tmp/m8b.gguf ] && [ ! -f /tmp/llama/converting ]; then
  touch /tmp/llama/converting
  if [ "$PHASE" = one ]; then convert >/tmp/llama/convert.log & else convert; fi
fi
wait_llama() {  # the build and the GGUF, within the time left
  while [ ! -f /tmp/llama/rc ] || [ ! -f /tmp/m8b.gguf ]; do
    [ $((LIMIT - SECONDS)) -gt 60 ] || return 1
    sleep 1
  done
  echo "llama.cpp build: rc $(cat /tmp/llama/rc) at ${SECONDS} s"
}
if [ "$llama" = 1 ] && [[ $PHASE == prep || $PHASE == run ]]; then  # one, seq: wait below
  LIMIT=$((SECONDS + 480)) wait_llama || echo "llama.cpp build: still running at ${SECONDS} s"
fi
[ "$PHASE" = prep ] && exit 0

one_run() {  # one server at one N, within the time left; its files under $AC
  local server=$1 n=$2 extra=() left
  # ds4pool:before serves the package exported to $BEFORE (git archive REF ds4pool), carried
  [ "$server" = ds4pool:before ] && extra=(--before-ref "${BEFORE:?ds4pool:before needs BEFORE=dir}")
  if [ "$server" = llama-server ]; then
    wait_llama || { echo "llama-server: not built in time"; return; }
    extra=(--gguf /tmp/m8b.gguf --llama-server "$SRC/b/bin/llama-server" --llama-slots agents
      --llama-slot-ctx 4096 --llama-args "-ngl 99 -fa on --cache-ram 0")
  fi
  left=$((LIMIT - SECONDS))
  [ "$left" -gt 30 ] || { echo "no time left for $server N=$n"; return; }
  timeout "$left" "${PIN[@]}" python3 bench/agents_compare.py --servers "$server" "${WORK[@]}" \
    "${VARIANT_ARGS[@]}" "${extra[@]}" --agents "$n" --out "$AC/$server-$n" 2>&1 |
    grep -E "^\| $server |^FAILED|^$server-N$n: "
  echo "  ($server N=$n ended at ${SECONDS} s)"
  # the device's file return refuses names with ":" (ds4pool:NAME): "_" in the archive's
  tar czf "$OUT/${server//:/_}-$n.tgz" -C "$AC" "$server-$n" 2>/dev/null
}
if [ "$PHASE" = seq ]; then
  # only where llama-server is measured (session 34 lost 170 s of a call waiting for a build
  # that no listed server needed)
  [ "$llama" = 1 ] && { wait_llama || echo "llama.cpp: not built in time"; }
  for n in $AGENTS; do for server in $SERVERS; do one_run "$server" "$n"; done; done
else
  for server in $SERVERS; do for n in $AGENTS; do one_run "$server" "$n"; done; done
fi
# one table and the target lines at every N over all the runs above (and earlier calls')
python3 bench/agents_compare.py --merge "$AC"/*/agents_compare.json --device cuda \
  --out "$OUT/all" 2>&1 | grep -E "^N=|^\| " | grep -v "^| server"
echo "done at ${SECONDS} s"
