#!/usr/bin/env bash
# The GPU suite in one call of the device tool (repo root on an nvidia-h200-x2 box; results in $OUT).
#   bash scripts/gpu_suite.sh [PART ...]   PARTs: tests transform transfer model (default: all four)
#     tests     - the CUDA twins of the correctness tests (pytest -m gpu)
#     transform - transform throughput vs a plain copy (Triton and torch), 10-1280 MB
#     transfer  - `hawk bench transfer`, the five configurations, 10-1280 MB, prefill GPU0 -> decode GPU1
#     model     - Llama-3.1-8B-shaped model: disaggregated vs colocated tokens, TTFT/TPOT
#     serving   - `hawk serve` (8B shape, bf16) under Poisson load: TTFT, TPOT, SLO attainment vs rate
#     smoke     - a quick end-to-end check after changes: small transfers and a tiny model on the GPUs
#     reverse   - the reverse direction (ng-hawk: NPU prefill on GPU0's memory -> GPU decode on GPU1) beside gg-direct
#     engine    - `hawk bench engine`: 8B decode step / prefill times vs read-bandwidth and GEMM ceilings (GPU0 only)
#     ttft      - `hawk bench ttft`: TTFT disaggregated / colocated at 1k/4k/16k, pull and layer-wise push (both roles on GPU0)
#     bfp8      - the bfloat8_b NPU-tile decode variants against the paged decode (benchmarks/bfp8_kernel_probe.py)
#     sameg     - one GPU, both roles: the auto transport's tests, Fig. 9 sizes vs a same-run device copy, TTFT at 1k/4k/16k
#     quick     - the acceptance points in one short call: transform v1/v2 vs copy, one-GPU transfers vs a device copy,
#                 engine decode at batch 1/64 (1k) and prefill 2k
#     paced     - issue 10: real serving with --npu-timing p150a --link-gbps 200 (gn-hawk, gg-direct, gn-host) beside the
#                 simulator's `here` prediction calibrated from probes of the same system (benchmarks/cross_validate.py);
#                 PACED_WORKLOAD="chatbot summarization", PACED_RATES, PACED_REQUESTS, PACED_CONFIGS, PACED_LIMIT, PACED_KV_DTYPE, PACED_TILIZE=1
#     capture   - the prefill's first forward in a new CUDA-graph bucket (two prompts) against its replay, by total tokens
#                 (benchmarks/prefill_graph_capture_probe.py; the paced cross-validation's first-use cost reads it)
#     kernels   - the CUDA tests of the attention kernels (paged, NPU-tile) and the fused ops
#     tp        - 8B token equality across tensor-parallel degrees: prefill TP2 -> decode TP1, TP1 -> TP2 (two GPUs)
#     fig9      - Fig. 9 on two GPUs with >= 10 repeats (median, IQR): every configuration, bf16 and bfloat8_b NPU KV
#                 (FIG9_KV_DTYPES picks one: a call fits one of the two next to another part)
#     ttft2     - `hawk bench ttft` across two GPUs (prefill GPU0, decode GPU1): pull and layer-wise push at 1k/4k/16k
#     sweeps    - serving sweeps (chatbot, summarization) of gn-hawk, gn-host, gg-direct, gg-host with and without
#                 --npu-timing p150a --link-gbps 200 (eight servers: more than one call; SWEEP_CONFIGS/SWEEP_TIMING)
#     tpserve   - one serving rate with prefill TP2 (GPU0+GPU1) and the decode on GPU1
#     pairs     - issue 7's NPU-tile / paged decode ratios at 1k, each run pairing the steps round by round: ENGINE_RUNS
#                 processes at batch 1 (ENGINE_REPLICAS builds of each point), one at batch 64, then
#                 benchmarks/engine_runs_summary.py
#     t16       - the 16-token, 64-split bfloat8_b variant (regs-fw-early-t16s64) against the default at batch 1 / 1k:
#                 its GPU tests, the kernel probe, the 8B step (two builds of each point)
#     newrow    - the bfloat8_b kernel's new-row program and RoPE in the launch (regs-fw-early-m4-nr, -rope, -nr-rope,
#                 the default) against regs-fw-early-m4: their GPU tests, the kernel probe at 1 / 8 / 64 x 1k, the 8B
#                 step at batch 1 (two builds of each point, per-kernel times) and 64
#     saturation - issue 31: `hawk bench serving --saturation` (chatbot, 8B shape, bf16, default capacity) against colocated
#                 and gn-hawk with both roles on GPU0 (transport auto), each beside its same-run bound; then
#                 `python -m hawk.bench.saturation summarize` -> $OUT/saturation_h200.json (SAT_START rate, SAT_DURATION s or
#                 SAT_REQUESTS per rate, SAT_CONFIGS: one server per call at 30 s a rate, colocated, gn-hawk_gpu0 or
#                 colocated-mixed-graphs, colocated-mixed192 (--mixed-graphs --step-token-target 192), gn-hawk_gpu0_bfp8; SAT_SERVE_ARGS: more hawk serve flags, e.g. "--api-server-count 4";
#                 SAT_BOUND_BATCH: the bound's decode batch, 256 by default; the bench lowers it to the server's --max-num-seqs)
#     steps     - the engine's step paths on CUDA: the runner's graphs (decode, prefill, graph pieces for a mixed batch
#                 past 16 sequences, e.g. 48 and 256 decode rows beside a 512-token chunk on the 8B layer shapes), async
#                 scheduling and overlapped mixed steps against the synchronous loop (pytest -m gpu)
#     mixedprobe - issue 31: an 8B mixed step (16-256 decode rows at context 850 beside a 64-512-token chunk) as graph pieces,
#                 then as mixed graphs, against its decode graph + prefill graph (GPU ms from CUDA events, host ms of the launch)
#                 (benchmarks/mixed_step_probe.py; one JSON line per point in $LOGS/mixed_step_probe.log)
#     router    - CPU per streamed token in the router and the engine process (benchmarks/router_probe.py, 8B shape
#                 colocated on GPU0, 64 and 256 streams, four router processes), with a decode stream per request
#                 and with the shared one (--decode-stream request|shared)
#     posts     - the host work of layer-wise posts on the forward's thread: `hawk bench ttft` at 1k (both roles on GPU0)
#                 under cProfile (--profile-posts), the profile in $OUT/ttft_posts_profile.txt
#     vllm      - issue 30: the fused transform reading vLLM 0.32's GPU layouts (views as vLLM's create_kv_cache_views makes
#                 them, tests/data/vllm_kv_layouts.json): its GPU tests byte-exact on every KVCacheLayout, then throughput
#                 from vLLM's default FlashAttention layout (LBNHC) and from HAWK's NHD, each against a same-run copy
#     rate80    - issue 31: colocated (8B shape, bf16) at one chatbot rate, RATE80_RATE (default 20.4: 80 % of its saturation),
#                 under several step policies, one server each: RATE80_ARGS="name=hawk serve flags;name=flags;..." ->
#                 $OUT/rate80_<name>.json (RATE80_REQUESTS per server, default 300)
#     steptrace - issue 31: what a served prompt token costs. The step probe with the chunk after 0/256/512 cached tokens of
#                 its prompt (mixed graphs, token target 192, GPU time per kernel; hawk/sim/colocated.py reads its pair cost
#                 from the file), then colocated at STEPTRACE_RATE (20.4) req/s with HAWK_STEP_TRACE
#                 for each of STEPTRACE_CONFIGS ("default mixed192"), each trace fitted by benchmarks/step_trace_fit.py ->
#                 $OUT/mixed_step_offsets_h200.jsonl, $OUT/step_fit_<config>.json, $OUT/step_trace_<config>.tgz
#     rowsplit  - issue 31: an 8B mixed step and decode step (16 and 48 rows at context 850, the first row at 0/2000/4000 tokens)
#                 with the decode kernel's splits by rows, then with --decode-split-tokens ROWSPLIT_TOKENS (512): what a long
#                 row costs a step and what splitting rows by length gives back -> $OUT/rowsplit_{0,512}_h200.jsonl; then
#                 RATE80_ARGS="mixed192=--mixed-graphs --step-token-target 192;mixed192s=... --decode-split-tokens 512" rate80
#     prefillattn - issue 31: the prefill attention kernel on a later chunk (128/224 query tokens after 0-768 cached, one and two
#                 prompts) per launch shape against torch's SDPA on the same data (benchmarks/prefill_attention_probe.py)
#                 -> $OUT/prefill_attention_h200.jsonl; torch + Triton only, about a minute
# LOGS=DIR keeps the per-step logs out of $OUT (the device tool returns at most 8 files); each step's tail still prints.
# Wheels missing on the box (nixl, nixl_cu13, pyzmq for cp312) are carried in .whl/ (see docs/gpu.md).
set -uo pipefail
parts=" ${*:-tests transform transfer model serving} "
want() { [[ "$parts" == *" $1 "* ]]; }
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export HAWK_TRACEBACK=1 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
dec=1; [ "$ngpu" -lt 2 ] && dec=0  # one GPU: both roles on it (label the results so)
post=pull; [ "$dec" = 0 ] && post=push  # one GPU: the prefill WRITEs (docs/gpu.md); NIXL there is slow READ and WRITE alike (docs/transport.md)

LOGS=${LOGS:-$OUT}
mkdir -p "$LOGS"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s)"; local t0=$SECONDS; timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -v "NIXL INFO"; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"; }

want tests && \
  step gpu_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_transform.py tests/test_transport.py tests/test_devices.py
if want vllm; then
  step vllm_tests 110 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_vllm_triton.py
  for src in LBNHC NHD; do
    step "transform_$src" 60 python3 -m hawk.bench.transform --impls triton --sizes-mb 80,320,1280 --dtypes bf16 \
      --blocks shuffled --src-layout $src --json "$OUT/transform_${src}_h200.json"
  done
fi
if want router; then  # four router processes, a decode stream per request, then the shared one (--decode-stream)
  for ds in request shared; do
    step "router_probe_x4_$ds" 280 python3 benchmarks/router_probe.py --streams 64,256 --tokens 300 --json "$OUT/router_probe_h200_x4_$ds.json" \
      -- --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 --transfer colocated --api-server-count 4 --decode-stream $ds
  done
fi
want steps && \
  step gpu_steps 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_runner.py tests/test_async_scheduling.py tests/test_mixed_steps.py
if want mixedprobe; then
  step mixed_step_probe 300 python3 benchmarks/mixed_step_probe.py --batches 16,48,128,256 --context 850 --chunk 64,128,256,512
  step mixed_graph_probe 200 python3 benchmarks/mixed_step_probe.py --mixed-graphs --batches 16,48,128,256 --context 850 --chunk 64,128,256,512
fi
want capture && \
  step prefill_graph_capture 240 python3 benchmarks/prefill_graph_capture_probe.py --json "$OUT/prefill_graph_capture_h200.json"
want kernels && \
  step gpu_kernels 480 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_attention.py tests/test_npu_attention.py tests/test_triton_ops.py
want transform && \
  step transform 200 python3 -m hawk.bench.transform --sizes-mb 10,80,320,1280 --dtypes bf16,bfp8_b --blocks contiguous,shuffled --json "$OUT/transform_h200.json"
want transfer && \
  step transfer 330 python3 -m hawk.cli bench transfer --transport nixl --prefill-device cuda:0 --npu-device npu-emu:cuda:$dec \
    --gpu-decode-device cuda:$dec --sizes-mb 10,20,40,80,160,320,640,1280 --repeats 5 \
    --configs gg-host,gn-host,gg-direct,gn-direct-single,gn-hawk,gn-hawk@staging,gn-hawk@direct \
    --json "$OUT/transfer_h200x2.json" --plot "$OUT/transfer_h200x2.png"
want model && \
  step model_8b 200 python3 -m hawk bench equivalence --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 \
    --decode-device npu-emu:cuda:$dec --configs gn-hawk,gg-direct --max-tokens 32 --kv-tokens 8192 --json "$OUT/e2e_8b_h200x2.json"
# One GPU, both roles: Fig. 9 sizes against a same-run device copy, and TTFT at 1k/4k/16k (parts sameg, quick, ttft).
same_gpu_transfers() {  # same_gpu_transfers LIMIT
  step transfer_h200x1 "$1" python3 -m hawk.cli bench transfer --transport auto --prefill-device cuda:0 --npu-device npu-emu:cuda:0 \
    --gpu-decode-device cuda:0 --sizes-mb 10,80,320,1280 --repeats 10 --configs gg-direct,gn-hawk --json "$OUT/transfer_h200x1.json"
}
ttft_one_gpu() {  # ttft_one_gpu NAME LIMIT TRANSPORT
  step "$1" "$2" python3 -m hawk bench ttft --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 --decode-device npu-emu:cuda:0 \
    --transport "$3" --prompts 1024,4096,16384 --configs gn-hawk,gg-direct --kv-flows pull,layerwise --repeats 5 --warmup 1 --json "$OUT/ttft_h200.json"
}

want bfp8 && \
  step bfp8_probe 200 python3 benchmarks/bfp8_kernel_probe.py --json "$OUT/bfp8_kernel_probe.json"
if want sameg; then
  step auto_tests 120 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_transport_auto.py
  same_gpu_transfers 150
  ttft_one_gpu ttft_auto 170 auto
fi
if want quick; then  # most important first: a call cut short keeps what ran
  step engine_quick 200 python3 -m hawk.bench.engine --device cuda:0 --model llama-3.1-8b --dtype bf16 --batches 1,64 --contexts 1024 \
    --prefill-tokens 2048 --paths gpu-paged,npu-tile --kv-dtypes bf16,bfp8_b --steps 30 --point-budget-s 8 --time-budget-s 140 \
    --json "$OUT/engine_h200.json"
  step copy_tests 60 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_devices.py tests/test_transport_auto.py -k "copy_spans or same_gpu"
  same_gpu_transfers 100
  ttft_one_gpu ttft_auto 90 auto
  step transform_v2 110 python3 -m hawk.bench.transform --impls triton --kernels v1,v2 --sizes-mb 10,80,320,1280 \
    --dtypes bf16,bfp8_b --blocks contiguous --json "$OUT/transform_h200.json"
fi
if want paced; then  # one system per configuration, each its own file, so a call cut short keeps what finished
  # PACED_WORKLOAD picks the workloads (space-separated), PACED_RATES the rates, PACED_LIMIT each system's seconds;
  # PACED_TILIZE=1 first measures the host's tilize rate (gn-host's fix-up runs on the decode node's CPU)
  [ "${PACED_TILIZE:-0}" = 1 ] && step cpu_tilize 60 python3 -m hawk.bench.transform --device cpu --shape llama70b-tp4 --sizes-mb 32 \
    --dtypes bf16,bfp8_b --blocks contiguous --repeats 3 --warmup 1 --json "$OUT/transform_cpu_host.json"
  for w in ${PACED_WORKLOAD:-chatbot}; do
    for t in ${PACED_CONFIGS:-gn-hawk gg-direct gn-host}; do
      step "paced_${w}_$t" "${PACED_LIMIT:-155}" python3 benchmarks/cross_validate.py --scenarios paced --link-gbps 200 --prefill-device cuda:0 \
        --decode-device npu-emu:cuda:0 --model llama-3.1-8b --dtype bf16 --workload "$w" --rates "${PACED_RATES:-1,2}" \
        --num-requests "${PACED_REQUESTS:-20}" --kv-dtype "${PACED_KV_DTYPE:-bf16}" --transfer "$t" --transport auto \
        --json "$OUT/crossval_h200_${w}_$t.json"
    done
  done
fi
if want pairs; then  # separate processes and replicas: where a point's memory lands moved the batch-1 ratio by +-0.4 %
  for i in $(seq 1 "${ENGINE_RUNS:-2}"); do
    step "engine_b1_run$i" 200 python3 -m hawk.bench.engine --device cuda:0 --model llama-3.1-8b --dtype bf16 --batches 1 \
      --contexts 1024 --prefill-tokens '' --paths gpu-paged,npu-tile --kv-dtypes bf16,bfp8_b --steps 300 --point-budget-s 8 \
      --replicas "${ENGINE_REPLICAS:-3}" --json "$LOGS/engine_b1_run$i.json"
  done
  step engine_b64 150 python3 -m hawk.bench.engine --device cuda:0 --model llama-3.1-8b --dtype bf16 --batches 64 \
    --contexts 1024 --prefill-tokens '' --paths gpu-paged,npu-tile --kv-dtypes bf16,bfp8_b --steps 100 --point-budget-s 8 \
    --replicas 2 --json "$LOGS/engine_b64.json"
  step engine_pairs 30 python3 benchmarks/engine_runs_summary.py "$LOGS"/engine_b1_run*.json "$LOGS/engine_b64.json" \
    --json "$OUT/engine_pairs_h200.json"
fi
if want t16; then
  step t16_gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_npu_attention.py -k t16s64
  step t16_probe 90 python3 benchmarks/bfp8_kernel_probe.py --points 1x1024,8x1024 --variants regs-fw-early-m4,regs-fw-early-t16s64 \
    --flush-mb 256 --json "$OUT/bfp8_probe_t16.json"
  p=gpu-paged:bf16,npu-tile:bfp8_b:regs-fw-early-m4,npu-tile:bfp8_b:regs-fw-early-t16s64
  step t16_step 150 python3 benchmarks/decode_step_probe.py --batch 1 --context 1024 --steps 100 --points "$p,$p" --json "$OUT/step_t16.json"
fi
if want newrow; then
  step newrow_gpu_tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_npu_attention.py -k "nr or rope or m4 or rotating"
  step newrow_probe 90 python3 benchmarks/bfp8_kernel_probe.py --points 1x1024,8x1024,64x1024 \
    --variants regs-fw-early-m4,regs-fw-early-m4-nr --flush-mb 256 --json "$OUT/bfp8_probe_newrow.json"
  p=gpu-paged:bf16,npu-tile:bfp8_b:regs-fw-early-m4,npu-tile:bfp8_b:regs-fw-early-m4-rope
  p=$p,npu-tile:bfp8_b:regs-fw-early-m4-nr,npu-tile:bfp8_b:regs-fw-early-m4-nr-rope
  step newrow_step_b1 200 python3 benchmarks/decode_step_probe.py --batch 1 --context 1024 --steps 100 --kernels \
    --points "$p,$p" --json "$OUT/step_newrow_b1.json"
  step newrow_step_b64 110 python3 benchmarks/decode_step_probe.py --batch 64 --context 1024 --steps 40 --points "$p" \
    --json "$OUT/step_newrow_b64.json"
fi
want ttft && ttft_one_gpu ttft 240 nixl  # NIXL within one GPU: the slow path auto avoids
want posts && \
  step ttft_posts 150 python3 -m hawk bench ttft --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 --decode-device npu-emu:cuda:0 \
    --transport auto --prompts 1024 --configs gn-hawk,gg-direct --kv-flows layerwise --repeats 5 --warmup 1 \
    --json "$OUT/ttft_posts_h200.json" --profile-posts "$OUT/ttft_posts_profile.txt"
if want fig9 && [ "$ngpu" -ge 2 ]; then
  for kvd in ${FIG9_KV_DTYPES:-bf16 bfp8_b}; do
    step "fig9_$kvd" 280 python3 -m hawk.cli bench transfer --transport nixl --prefill-device cuda:0 --npu-device npu-emu:cuda:1 \
      --gpu-decode-device cuda:1 --sizes-mb 10,20,40,80,160,320,640,1280 --repeats 10 --kv-dtype "$kvd" \
      --configs gg-host,gn-host,gg-direct,gn-direct-single,gn-hawk,gn-hawk@staging,gn-hawk@direct \
      --json "$OUT/transfer_h200x2_$kvd.json"
  done
fi
if want ttft2 && [ "$ngpu" -ge 2 ]; then
  step ttft_h200x2 240 python3 -m hawk bench ttft --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 --decode-device npu-emu:cuda:1 \
    --transport auto --prompts 1024,4096,16384 --configs gn-hawk,gg-direct --kv-flows pull,layerwise --repeats 3 --warmup 1 \
    --json "$OUT/ttft_h200x2.json"
fi
# A TP group takes consecutive GPUs from its instance's device (rank r on cuda:N+r), so TP2 needs two.
if want tp && [ "$ngpu" -ge 2 ]; then
  step tp_2to1 150 python3 -m hawk bench equivalence --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 \
    --decode-device npu-emu:cuda:1 --prefill-tp 2 --decode-tp 1 --configs gn-hawk,gg-direct --max-tokens 32 --kv-tokens 8192 --json "$OUT/tp_8b_2to1.json"
  step tp_1to2 200 python3 -m hawk bench equivalence --model llama-3.1-8b --dtype bf16 --prefill-device cuda:1 \
    --decode-device npu-emu:cuda:0 --prefill-tp 1 --decode-tp 2 --configs gn-hawk,gg-direct --max-tokens 32 --kv-tokens 8192 --json "$OUT/tp_8b_1to2.json"
fi
want smoke && \
  step smoke_transfer 120 python3 -m hawk.cli bench transfer --transport nixl --prefill-device cuda:0 --npu-device npu-emu:cuda:$dec \
    --gpu-decode-device cuda:$dec --sizes-mb 10,80 --repeats 2 --configs gn-host,gg-direct,gn-hawk --npu-shard-pages 2 \
    --json "$OUT/smoke_transfer.json"
want smoke && \
  step smoke_model 150 python3 -m hawk bench equivalence --model tiny --dtype bf16 --prefill-device cuda:0 \
    --decode-device npu-emu:cuda:$dec --configs gn-hawk,gn-host,gg-direct --max-tokens 16 --kv-tokens 2048 --json "$OUT/smoke_model.json"

want reverse && \
  step reverse 150 python3 -m hawk.cli bench transfer --transport nixl --prefill-device cuda:0 --npu-device npu-emu:cuda:$dec \
    --gpu-decode-device cuda:$dec --sizes-mb 10,80,320,1280 --repeats 3 --configs gg-direct,gn-hawk,ng-hawk \
    --json "$OUT/reverse_h200x2.json"

# One GPU: the model (16 GB of seeded random weights, built once), the paged caches and the emulated
# NPU's memory all on GPU0. --time-budget-s skips whatever is left (with a note) so the part ends
# within ~6 min; the JSON is rewritten after every point, so even a timeout keeps what was measured.
want engine && \
  step engine 390 python3 -m hawk.bench.engine --device cuda:0 --model llama-3.1-8b --dtype bf16 \
    --batches 1,8,32,64 --contexts 1024,8192 --prefill-tokens 512,2048,8192 --paths gpu-paged,npu-tile \
    --kv-dtypes bf16,bfp8_b --steps 30 --point-budget-s 8 --time-budget-s 320 --json "$OUT/engine_h200.json"

wait_health() {  # wait_health PORT PID SECONDS: until the server answers /health, its process exits, or SECONDS pass
  for _ in $(seq 1 "$3"); do curl -sf "127.0.0.1:$1/health" > /dev/null && return; kill -0 "$2" 2> /dev/null || return; sleep 1; done
}
engine_counters() {  # engine_counters PORT: the engines' step counts and loop clock so far (hawk/engine/loop_clock.py), one line
  curl -s "127.0.0.1:$1/metrics" | grep -E "_engine_(steps|loop)_" | grep -v "^#" | sed -E 's/^hawk_([a-z]+)_engine_([a-z_]+)\{[^}]*\}/\1.\2/' | paste -sd' '
}
serve_bench() {  # serve_bench NAME CONFIG DECODE_DEVICE RATES "WORKLOADS" [hawk serve args...]: one server, its sweeps, clean stop
  local name=$1 cfg=$2 dev=$3 rates=$4 workloads=$5 port=8100; shift 5
  python3 -c 'import fastapi, uvicorn, httpx, zmq' || { echo "serving needs fastapi/uvicorn/pydantic wheels (docs/gpu.md)"; return 1; }
  python3 -m hawk serve --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 --decode-device "$dev" \
    --transfer "$cfg" --port $port --kv-tokens 65536 --post "$post" "$@" > "$LOGS/serve_$name.log" 2>&1 &
  local spid=$!
  wait_health $port $spid 240
  for w in $workloads; do
    step "serving_${name}_$w" 200 python3 -m hawk.bench.serving_cli --url http://127.0.0.1:$port --workload "$w" \
      --rates "$rates" --num-requests "${SERVE_REQUESTS:-30}" --output-scale 0.25 --json "$OUT/serving_${name}_$w.json"
  done
  kill -INT $spid; wait $spid
}
if want serving; then
  serve_bench gn-hawk gn-hawk npu-emu:cuda:$dec 1,2,4,8 chatbot
  serve_bench gg-direct gg-direct cuda:$dec 1,2,4,8 chatbot
fi
# Issue 31: saturation at the default capacity (no --kv-tokens, --max-num-seqs: the memory rule and 256 sequences),
# colocated (mixed steps) and gn-hawk with both roles on GPU0 (its KV moved by device copy: --transport auto).
sat_bench() {  # sat_bench NAME TRANSFER DECODE_DEVICE BOUND_BATCH [hawk serve args...]: one server, its ramp, clean stop
  local name=$1 cfg=$2 dev=$3 bound=$4 port=8100; shift 4
  python3 -c 'import fastapi, uvicorn, httpx, zmq' || { echo "serving needs fastapi/uvicorn/pydantic wheels (docs/gpu.md)"; return 1; }
  python3 -m hawk serve --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 --decode-device "$dev" \
    --transfer "$cfg" --port $port "$@" ${SAT_SERVE_ARGS:-} > "$LOGS/serve_sat_$name.log" 2>&1 &
  local spid=$!
  wait_health $port $spid 300
  grep "KV cache" "$LOGS/serve_sat_$name.log"
  step "saturation_$name" "${SAT_LIMIT:-480}" python3 -m hawk.bench.serving_cli --url http://127.0.0.1:$port --workload chatbot --saturation \
    --rates "${SAT_START:-8}" --num-requests "${SAT_REQUESTS:-150}" --rate-duration-s "${SAT_DURATION:-30}" --bound-batch "$bound" \
    --config "$name" --json "$OUT/saturation_$name.json"
  echo "engine $name: $(engine_counters $port)"
  kill -INT $spid; wait $spid
}
# A rate runs at least SAT_DURATION seconds (a steady state at 40 req/s needs many 4-s requests), so one server's
# ramp takes minutes: SAT_CONFIGS="colocated" and SAT_CONFIGS="gn-hawk_gpu0" in two calls, then summarize both here.
if want saturation; then
  for c in ${SAT_CONFIGS:-colocated gn-hawk_gpu0}; do
    case $c in
      colocated) sat_bench colocated colocated cuda:0 "${SAT_BOUND_BATCH:-256}" ;;
      gn-hawk_gpu0) sat_bench gn-hawk_gpu0 gn-hawk npu-emu:cuda:0 0 --transport auto ;;  # no bound: measured against colocated
      colocated-mixed-graphs) sat_bench colocated-mixed-graphs colocated cuda:0 "${SAT_BOUND_BATCH:-256}" --mixed-graphs ;;  # against colocated's pieces
      colocated-mixed192) sat_bench colocated-mixed192 colocated cuda:0 "${SAT_BOUND_BATCH:-256}" --mixed-graphs --step-token-target 192 ;;  # the best TPOT at 80 % (docs/throughput.md)
      gn-hawk_gpu0_bfp8) sat_bench gn-hawk_gpu0_bfp8 gn-hawk npu-emu:cuda:0 0 --transport auto --kv-dtype bfp8_b ;;  # the NPU's KV in bfloat8_b
    esac
  done
  python3 -m hawk.bench.saturation summarize "$OUT/saturation_colocated.json" "$OUT/saturation_gn-hawk_gpu0.json" "$OUT/saturation_colocated-mixed-graphs.json" \
    "$OUT/saturation_gn-hawk_gpu0_bfp8.json" "$OUT/saturation_colocated-mixed192.json" \
    --device "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), one GPU, both roles on GPU0 (emulated NPU)" \
    --command "bash scripts/gpu_suite.sh saturation" --out "$OUT/saturation_h200.json"
fi
if want steptrace; then
  step mixed_step_offsets 180 python3 benchmarks/mixed_step_probe.py --mixed-graphs --batches 48 --context 850 --chunk 128,224 \
    --chunk-offsets 0,256,512 --step-token-target 192 --kernels
  grep -E '"kind": "(decode|prefill|mixed|sum|kernels)"' "$LOGS/mixed_step_offsets.log" > "$OUT/mixed_step_offsets_h200.jsonl"
  for cfg in ${STEPTRACE_CONFIGS:-default mixed192}; do
    extra=(); [ "$cfg" = mixed192 ] && extra=(--mixed-graphs --step-token-target 192)
    mkdir -p "/tmp/steptrace_$cfg"
    OUT=/tmp/steptrace_$cfg STEP_TRACE=1 PROFILE_RATE=${STEPTRACE_RATE:-20.4} PROFILE_S=${STEPTRACE_S:-30} timeout 200 \
      bash benchmarks/serving_host_profile.sh --transfer colocated --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 "${extra[@]}" \
      2>&1 | tail -4
    cp "/tmp/steptrace_$cfg/step_fit.json" "$OUT/step_fit_$cfg.json"
    tar -C "/tmp/steptrace_$cfg" -czf "$OUT/step_trace_$cfg.tgz" .
  done
fi
if want prefillattn; then
  step prefill_attention 150 python3 benchmarks/prefill_attention_probe.py --chunks 128,224 --offsets 0,256,512,768 --seqs 1,2
  grep -E '"kind": "(sdpa|config|summary)"' "$LOGS/prefill_attention.log" > "$OUT/prefill_attention_h200.jsonl"
fi
if want rowsplit; then  # one long row among 850-token ones: the decode kernel's splits by rows, then by the rows' lengths
  step rowsplit_tests 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_paged_attention.py -k "split"
  for st in 0 ${ROWSPLIT_TOKENS:-512}; do
    step "rowsplit_$st" 200 python3 benchmarks/mixed_step_probe.py --mixed-graphs --batches 16,48 --context 850 --chunk 192 \
      --step-token-target 192 --longest 0,2000,4000 --decode-split-tokens "$st"
    grep -E '"kind": "(decode|prefill|mixed|sum)"' "$LOGS/rowsplit_$st.log" > "$OUT/rowsplit_${st}_h200.jsonl"
  done
fi
if want rate80; then
  IFS=';' read -ra r80 <<< "${RATE80_ARGS:-default=}"
  for kv in "${r80[@]}"; do
    name=${kv%%=*}; args=${kv#*=}
    # shellcheck disable=SC2086  # the flags split on purpose
    python3 -m hawk serve --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 --decode-device cuda:0 --transfer colocated \
      --port 8100 $args > "$LOGS/serve_rate80_$name.log" 2>&1 &
    spid=$!
    wait_health 8100 $spid 300
    echo "rate80 $name: hawk serve ... $args"
    step "rate80_$name" 240 python3 -m hawk.bench.serving_cli --url http://127.0.0.1:8100 --workload chatbot \
      --rates "${RATE80_RATE:-20.4}" --num-requests "${RATE80_REQUESTS:-300}" --warmup 4 --json "$OUT/rate80_$name.json"
    echo "engine $name: $(engine_counters 8100)"
    kill -INT $spid; wait $spid
  done
fi
# Issue 12: the four configurations, prefill GPU0 -> decode GPU1, as fast as they run and with timing emulated
# (gn-*: the p150a's NPU steps and DRAM copies; all: a 200 Gb/s link); SWEEP_CONFIGS / SWEEP_TIMING pick a subset,
# SWEEP_RATES the rates (default 0.5,1,2,4), SERVE_REQUESTS the requests per rate (default 30).
if want sweeps; then
  for cfg in ${SWEEP_CONFIGS:-gn-hawk gn-host gg-direct gg-host}; do
    d=npu-emu:cuda:$dec; [[ $cfg == gg-* ]] && d=cuda:$dec
    r=${SWEEP_RATES:-0.5,1,2,4}
    for timing in ${SWEEP_TIMING:-off p150a}; do
      if [ "$timing" = off ]; then serve_bench "$cfg" "$cfg" "$d" "$r" "chatbot summarization"
      elif [[ $cfg == gg-* ]]; then serve_bench "${cfg}_link200" "$cfg" "$d" "$r" "chatbot summarization" --link-gbps 200
      else serve_bench "${cfg}_p150a" "$cfg" "$d" "$r" "chatbot summarization" --npu-timing p150a --link-gbps 200; fi
    done
  done
fi
# Issue 12: one serving rate with a tensor-parallel prefill (TP2 on GPU0+GPU1) and the decode on GPU1.
if want tpserve && [ "$ngpu" -ge 2 ]; then
  serve_bench tp2_gn-hawk gn-hawk npu-emu:cuda:1 2 chatbot --prefill-tp 2
fi
exit 0
