#!/usr/bin/env bash
# HAWK colocated against vLLM's CPU build on this box, one run, one server at a time (issue 31's CPU
# acceptance): each server's saturation ramp, then each at half of vLLM's saturation rate; SmolLM2-135M in
# bf16, the chatbot workload scaled to ~257 prompt / ~55 output tokens. With HAWK_DISAGG=1 (the default)
# HAWK disaggregated (gn-hawk: a CPU prefill and the emulated NPU's decode, KV moved over HAWK's transfer)
# runs the same two, laid beside them. Writes OUT/saturation_vs_vllm_cpu.json (python -m hawk.bench.saturation
# compare) beside each server's records and log. About 20 minutes on 2 cores, 30 with HAWK_DISAGG=1.
#
#   flock /tmp/hawk-cpu-bench.lock bash benchmarks/saturation_vs_vllm_cpu.sh [OUT]
#
# HAWK_ARGS: more `hawk serve` flags (e.g. "--prompt-threads 1": no borrowed thread for prompt steps).
# vLLM runs without its prefix cache, because HAWK has none; both hold 46,592 KV tokens (vLLM's 1 GiB).
set -euo pipefail
out=${1:-/tmp/saturation_vs_vllm_cpu}
hf=${HF_DIR:-/tmp/smollm2_hf}
mkdir -p "$out"
[ -f "$hf/config.json" ] || python -m hawk export-hf "$hf"

bench() {  # URL, then more `hawk bench serving` flags
  python -m hawk bench serving --url "$1" --workload chatbot --input-scale 0.341 --output-scale 0.32 \
    --model smollm2-135m "${@:2}"
}
up() {  # URL PID: wait until the server answers /health, or fail if it died
  for _ in $(seq 600); do
    curl -sf -m 2 "$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || { echo "server at $1 died" >&2; return 1; }
    sleep 1
  done
  return 1
}
stop() {  # a server started with setsid: SIGINT, then its whole group
  kill -INT "$1" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  kill -9 -- "-$1" 2>/dev/null || true
}
sat=(--saturation --rates 0.5 --num-requests 40 --rate-duration-s 40 --bound-batch 32 --max-steps 6)
stamp() { echo "$1: $(uptime)" >> "$out/uptime.txt"; }
: > "$out/uptime.txt"

stamp vllm_start
setsid python3 -m vllm.entrypoints.openai.api_server --model "$hf" --served-model-name smollm2-135m --enforce-eager \
  --kv-cache-memory-bytes 1073741824 --dtype bfloat16 --port 8032 --no-enable-prefix-caching > "$out/vllm.log" 2>&1 &
vp=$!
trap 'stop $vp' EXIT
up http://127.0.0.1:8032 "$vp"
bench http://127.0.0.1:8032 "${sat[@]}" --config vllm-noprefix --json "$out/vllm_sat.json" | tee "$out/vllm_sat.txt"
half=$(python -c 'import json, sys; d = json.load(open(sys.argv[1])); print(round(d["saturation_rps"] / 2, 3))' "$out/vllm_sat.json")
stamp "vllm_sat_end (half rate $half)"
bench http://127.0.0.1:8032 --rates "$half" --num-requests 40 --config vllm-noprefix --json "$out/vllm_half.json" | tee "$out/vllm_half.txt"
stop "$vp"
stamp hawk_start
# shellcheck disable=SC2086  # HAWK_ARGS is a list of flags
setsid python -m hawk serve --transfer colocated --dtype bf16 --kv-tokens 46592 --port 8033 ${HAWK_ARGS:-} > "$out/hawk.log" 2>&1 &
hp=$!
trap 'stop $hp' EXIT
up http://127.0.0.1:8033 "$hp"
bench http://127.0.0.1:8033 "${sat[@]}" --config hawk-colocated --json "$out/hawk_sat.json" | tee "$out/hawk_sat.txt"
stamp hawk_sat_end
bench http://127.0.0.1:8033 --rates "$half" --num-requests 40 --config hawk-colocated --json "$out/hawk_half.json" | tee "$out/hawk_half.txt"
stop "$hp"
stamp hawk_end
also=()
if [ "${HAWK_DISAGG:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  setsid python -m hawk serve --transfer gn-hawk --dtype bf16 --kv-tokens 46592 --port 8034 ${HAWK_ARGS:-} > "$out/hawk_gn.log" 2>&1 &
  gp=$!
  trap 'stop $gp' EXIT
  up http://127.0.0.1:8034 "$gp"
  bench http://127.0.0.1:8034 "${sat[@]}" --config hawk-gn-hawk --json "$out/hawk_gn_sat.json" | tee "$out/hawk_gn_sat.txt"
  bench http://127.0.0.1:8034 --rates "$half" --num-requests 40 --config hawk-gn-hawk --json "$out/hawk_gn_half.json" | tee "$out/hawk_gn_half.txt"
  stop "$gp"
  stamp hawk_gn_end
  also=(--also "$out/hawk_gn_sat.json" "$out/hawk_gn_half.json")
fi
python -m hawk.bench.saturation compare "$out/hawk_sat.json" "$out/vllm_sat.json" "$out/hawk_half.json" "$out/vllm_half.json" "${also[@]}" \
  --device "$(nproc)-core CPU box ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); SmolLM2-135M bf16, one server at a time" \
  --command "bash benchmarks/saturation_vs_vllm_cpu.sh (HAWK_ARGS='${HAWK_ARGS:-}', HAWK_DISAGG=${HAWK_DISAGG:-1}) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
  --out "$out/saturation_vs_vllm_cpu.json"
