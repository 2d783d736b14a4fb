#!/usr/bin/env bash
# Where a loaded server's time goes: one `hawk serve` configuration held at one request rate while the
# GPU's utilization, each process's CPU (router, engine, bench client) and the engine's threads are
# sampled, and py-spy (when its wheel is carried in .whl/) records the engine's and the router's stacks.
#
#   PROFILE_RATE=18 PROFILE_S=40 bash benchmarks/serving_host_profile.sh [hawk serve args...]
#   (PYSPY_IDLE=1: the engines' stacks include idle samples, where a thread waits on a lock or the GIL;
#   GIL_SWITCH_MS=0.5: the server's processes hand the interpreter lock between threads that often instead
#   of CPython's 5 ms, through a sitecustomize.py put first on their PYTHONPATH (it shadows any other);
#   STEP_TRACE=1: the engines write a line per step, HAWK_STEP_TRACE, and benchmarks/step_trace_fit.py fits
#   what a served step costs against what it carried: $OUT/step_fit.json;
#   python benchmarks/profile_summary.py $OUT reads the outputs)
#
# Default server: colocated, 8B shape, bf16, cuda:0, default capacity. Writes under $OUT:
# serve.log, bench.json, gpu_util.csv, cpu.txt (per-process and per-thread CPU seconds over the window),
# pyspy_engine_<pid>.txt (each engine process: prefill and decode of a disaggregated server) / pyspy_router.txt
# (collapsed stacks), metrics_before/after.txt.
set -uo pipefail
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
RATE=${PROFILE_RATE:-18}; DUR=${PROFILE_S:-40}; PORT=${PORT:-8100}
export PYTHONUNBUFFERED=1 UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD
fi
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--transfer colocated --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0)
serve_path=$PYTHONPATH
[ -n "${STEP_TRACE:-}" ] && export HAWK_STEP_TRACE="$OUT/steps.jsonl"
if [ -n "${GIL_SWITCH_MS:-}" ]; then
  gil=$(mktemp -d); printf 'import sys\nsys.setswitchinterval(%s / 1000)\n' "$GIL_SWITCH_MS" > "$gil/sitecustomize.py"
  serve_path=$gil:$PYTHONPATH
fi
PYTHONPATH=$serve_path python3 -m hawk serve "${args[@]}" --port "$PORT" > "$OUT/serve.log" 2>&1 &
spid=$!
for _ in $(seq 1 300); do curl -sf "127.0.0.1:$PORT/health" > /dev/null && break; kill -0 $spid 2> /dev/null || break; sleep 1; done
grep -E "KV cache|max-num" "$OUT/serve.log"
engines=$(pgrep -f "hawk.serve.launcher" | tr "\n" " ")  # one per instance: a disaggregated server has two
echo "router $spid engines ${engines:-?}"
curl -s "127.0.0.1:$PORT/metrics" > "$OUT/metrics_before.txt"
n=$(python3 -c "print(int($RATE * $DUR))")
python3 -m hawk.bench.serving_cli --url "http://127.0.0.1:$PORT" --workload chatbot --rates "$RATE" --num-requests "$n" \
  --warmup 2 --config profile --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1 &
bpid=$!
sleep $((DUR / 4))  # past the ramp-up: the batch has filled
cpu() { for p in "$@"; do awk -v p="$p" '{print p, $14 + $15}' "/proc/$p/stat" 2> /dev/null; done; }
threads() { for t in /proc/"$1"/task/*; do awk -v t="${t##*/}" '{print t, $14 + $15}' "$t/stat" 2> /dev/null | paste - "$t/comm"; done; }
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > "$OUT/gpu_util.csv" &
npid=$!
{ echo "# ticks/s $(getconf CLK_TCK), window $((DUR / 2)) s, GIL switch interval ${GIL_SWITCH_MS:-5 (CPython default)} ms"; echo "## start"; cpu $spid $engines $bpid; for e in ${engines:-$spid}; do threads "$e"; done; } > "$OUT/cpu.txt"
if command -v py-spy > /dev/null; then
  for e in ${engines:-}; do
    py-spy record -p "$e" -d $((DUR / 2)) -r 50 -f raw -o "$OUT/pyspy_engine_$e.txt" --threads ${PYSPY_IDLE:+--idle} > "$OUT/pyspy_engine_$e.log" 2>&1 &
  done
  py-spy record -p "$spid" -d $((DUR / 2)) -r 50 -f raw -o "$OUT/pyspy_router.txt" --threads > "$OUT/pyspy_router.log" 2>&1 &
  py-spy record -p "$bpid" -d $((DUR / 2)) -r 50 -f raw -o "$OUT/pyspy_client.txt" --threads > "$OUT/pyspy_client.log" 2>&1 &
fi
sleep $((DUR / 2))
{ echo "## end"; cpu $spid $engines $bpid; for e in ${engines:-$spid}; do threads "$e"; done; } >> "$OUT/cpu.txt"
kill $npid 2> /dev/null
curl -s "127.0.0.1:$PORT/metrics" > "$OUT/metrics_after.txt"
wait $bpid; tail -5 "$OUT/bench.log"
sleep 2; kill -INT $spid; wait $spid
[ -n "${STEP_TRACE:-}" ] && python3 benchmarks/step_trace_fit.py "$OUT/steps.jsonl" --json "$OUT/step_fit.json"
# the device tool returns few files: the stacks travel as one archive
tar -C "$OUT" -czf "$OUT/profile.tgz" --remove-files $(cd "$OUT" && ls pyspy_* serve.log metrics_*.txt steps.jsonl 2> /dev/null)
