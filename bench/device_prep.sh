# Sourced by the device sequences (bench/h200_*.sh, run as bench/device_bg.sh's SEQ): R (the
# results folder) and `step` (a line in its seq.log) where the caller has none, the carried
# wheels of the server stack (.whl) installed into /tmp/site on PYTHONPATH, and the 8B-shaped
# random model of the agents workload at /tmp/m8b (vocab 1024, every id decodes to text), once
# per machine.
R=${R:-/tmp/res}
mkdir -p "$R"
type step >/dev/null 2>&1 || step() { echo "== $* at $(date +%T)" >>"$R/seq.log"; }  # run alone
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
step model
[ -f /tmp/m8b/config.json ] || python3 bench/write_random_model.py --preset llama3-8b \
  --vocab 1024 /tmp/m8b --device cuda --text-ids-only >$R/model.log 2>&1
