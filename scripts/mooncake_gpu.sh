#!/usr/bin/env bash
# Issue 12 item 5: `hawk bench transfer` with Mooncake's transfer engine between GPU0 (prefill) and GPU1
# (decode), GPU memory to GPU memory, beside NIXL. One call of the device tool (repo root on an
# nvidia-h200-x2 box, .whl_mooncake carried; results in $OUT):
#   bash scripts/mooncake_gpu.sh [PART ...]   PARTs: tests mooncake nixl tcp (default: tests mooncake nixl)
#     tests    - tests/test_mooncake_gpu.py: nvlink_intra between two processes (cuda:0 <-> cuda:1), bytes checked
#     mooncake - `hawk bench transfer --transport mooncake` (protocol nvlink_intra), gg-direct and gn-hawk, 10-1280 MB
#     nixl     - the same with --transport nixl, if NIXL's wheels are there
#     tcp      - Mooncake's TCP protocol on the same GPU memory (the engine stages it through host memory), 10-80 MB
#   bash scripts/mooncake_gpu.sh prepare [DIR]   (here, not on the box: fills DIR, default .whl_mooncake)
# Mooncake's protocol is nvlink_intra: the engine's intra-node NVLink transport (CUDA IPC handles exchanged in
# its P2P handshake, then cudaMemcpyBatchAsync GPU to GPU). No RDMA NIC and no metadata server (etcd) needed.
# Carried in $WHL (default .whl_mooncake/, ignored by git; docs/transport.md, "Mooncake"): the Mooncake and
# NIXL wheels for cp312 (slimmed by `prepare`; the stock Mooncake wheel works too), pyzmq, and
# mooncake_syslibs_bookworm.tar.xz: libibverbs, libmlx5, libnuma, libcurl (+ deps) from Debian 12, which the
# engine links but its wheel does not ship; only those the box lacks are put on LD_LIBRARY_PATH.
# Wheels in .whl/ (scripts/gpu_suite.sh's) are installed too when carried.
set -uo pipefail

# ---- `prepare [DIR]`: run HERE (a Debian machine with PyPI and Debian's archive), not on the box. Fills DIR
# (default .whl_mooncake) with what one call carries, Mooncake and NIXL together (~43 MB): both wheels slimmed
# to what HAWK loads (Mooncake: the transfer engine only, not the store/EP/PG binaries; NIXL: without
# nixl_ep_cu13 and UCX's perftest), each with a RECORD that matches, plus pyzmq and the system libraries.
if [ "${1:-}" = prepare ]; then
  dir=${2:-.whl_mooncake}
  tmp=$(mktemp -d)
  mkdir -p "$dir"
  py=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp")
  "${py[@]}" mooncake-transfer-engine-cuda13==0.3.14 nixl-cu13==1.5.1 pyzmq==27.3.0 || exit 1
  python3 -m pip download -q --no-deps -d "$tmp" nixl==1.5.1 || exit 1
  slim() {  # slim SRC DST DROP-REGEX...: the wheel without the members matching any regex
    python3 - "$@" << 'PYEOF'
import base64, hashlib, re, sys, zipfile
src, dst, drops = sys.argv[1], sys.argv[2], [re.compile(d) for d in sys.argv[3:]]
zin = zipfile.ZipFile(src)
record = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
rows = []
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        if info.filename == record or any(d.search(info.filename) for d in drops):
            continue
        data = zin.read(info)
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{info.filename},sha256={digest},{len(data)}")
    zout.writestr(zin.getinfo(record), "\n".join(rows + [f"{record},,"]) + "\n", compress_type=zipfile.ZIP_DEFLATED)
print(f"{dst}: {len(rows)} files")
PYEOF
  }
  for w in "$tmp"/mooncake_transfer_engine_cuda13-*.whl; do
    slim "$w" "$dir/$(basename "$w")" \
      '^mooncake/(?!(__init__\.py|engine\.so|engine\.pyi|py\.typed|libasio\.so|libetcd_wrapper\.so)$)' \
      '^mooncake_transfer_engine_cuda13\.libs/(?!(libyaml-cpp|libjsoncpp|libglog|libgflags)-)' '\.data/' || exit 1
  done
  for w in "$tmp"/nixl_cu13-*.whl; do
    slim "$w" "$dir/$(basename "$w")" '^nixl_ep_cu13/' 'libucx_perftest' '^nixl_cu13\.scripts/' '\.data/scripts/' || exit 1
  done
  cp "$tmp"/nixl-1.5.1-*.whl "$tmp"/pyzmq-*.whl "$dir/"
  # Libraries the engine links that its wheel leaves to the system, with their own, each under its SONAME.
  (cd "$tmp" && apt-get download libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1 libcurl4 \
    libnghttp2-14 libidn2-0 libunistring2 librtmp1 libssh2-1 libpsl5 libgssapi-krb5-2 libkrb5-3 libk5crypto3 \
    libkrb5support0 libkeyutils1 libcom-err2 libldap-2.5-0 libsasl2-2 libbrotli1 libgnutls30 libhogweed6 libnettle8 \
    libgmp10 libp11-kit0 libtasn1-6 libffi8 libssl3 zlib1g libzstd1 > /dev/null) || exit 1
  mkdir -p "$tmp/x" "$tmp/libs"
  for d in "$tmp"/*.deb; do dpkg -x "$d" "$tmp/x"; done
  find "$tmp/x" -type f -name 'lib*.so*' -not -path '*/libibverbs/*' | while read -r f; do
    so=$(readelf -d "$f" 2> /dev/null | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
    case "$so" in '' | libefa* | libmana* | libmlx4* | libbrotlienc*) ;; *) cp "$f" "$tmp/libs/$so" ;; esac
  done
  tar -C "$tmp/libs" -cJf "$dir/mooncake_syslibs_bookworm.tar.xz" .
  rm -rf "$tmp"
  ls -l "$dir"
  du -ch "$dir"/* | tail -1
  exit 0
fi
parts=" ${*:-tests mooncake nixl} "
want() { [[ "$parts" == *" $1 "* ]]; }
OUT=${OUT:-$PWD/out}
WHL=${WHL:-.whl_mooncake}
SITE=${SITE:-/tmp/site}
mkdir -p "$OUT"
export HAWK_TRACEBACK=1 PYTHONUNBUFFERED=1 UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MC_TRANSFER_TIMEOUT=${MC_TRANSFER_TIMEOUT:-30}

# ---- wheels: one pip call, one copy of each file name (pyzmq may be in both folders)
declare -A seen=()
wheels=()
for w in "$WHL"/*.whl .whl/*.whl; do
  [ -f "$w" ] || continue
  b=$(basename "$w")
  [ -n "${seen[$b]:-}" ] && continue
  seen[$b]=1
  wheels+=("$w")
done
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" || exit 1
  export PYTHONPATH=$SITE:$PWD
else
  export PYTHONPATH=$PWD
fi

# ---- shared libraries of Mooncake's engine: torch's CUDA runtime, then Debian's for whatever the box lacks
engine_so=$SITE/mooncake/engine.so
cudart_py='import glob, os, re, sys
import torch
need = b"libcudart.so.13"
if os.path.exists(sys.argv[1]):
    m = re.search(rb"libcudart[.]so[.][0-9]+", open(sys.argv[1], "rb").read())
    need = m.group() if m else need
pats = [os.path.join(p, "nvidia", "**", need.decode()) for p in sys.path if p and os.path.isdir(p)]
hits = [h for pat in pats for h in glob.glob(pat, recursive=True)]
print(os.path.dirname(hits[0]) if hits else "")'
cudart_dir=$(python3 -c "$cudart_py" "$engine_so" 2> /dev/null)
[ -n "$cudart_dir" ] && export LD_LIBRARY_PATH=$cudart_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
missing() { ldd "$engine_so" 2> /dev/null | awk '/not found/ {print $1}' | sort -u; }
if [ -f "$engine_so" ] && [ -n "$(missing)" ]; then
  echo "libraries the box lacks: $(missing | tr '\n' ' ')"
  if [ -f "$WHL/mooncake_syslibs_bookworm.tar.xz" ]; then
    rm -rf /tmp/mc_sys_all /tmp/mc_sys && mkdir -p /tmp/mc_sys_all /tmp/mc_sys
    python3 -c 'import sys, tarfile
kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
tarfile.open(sys.argv[1]).extractall(sys.argv[2], **kw)' "$WHL/mooncake_syslibs_bookworm.tar.xz" /tmp/mc_sys_all
    export LD_LIBRARY_PATH=/tmp/mc_sys${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    for _ in 1 2 3 4 5 6 7 8; do  # each round adds what is missing; a carried library may need more
      added=0
      for lib in $(missing); do
        if [ -e "/tmp/mc_sys_all/$lib" ] && [ ! -e "/tmp/mc_sys/$lib" ]; then
          ln -s "/tmp/mc_sys_all/$lib" "/tmp/mc_sys/$lib"
          added=1
        fi
      done
      [ "$added" = 0 ] && break
    done
    echo "carried libraries used: $(ls /tmp/mc_sys | tr '\n' ' ')"
  fi
  [ -n "$(missing)" ] && echo "WARNING: still missing for Mooncake's engine: $(missing | tr '\n' ' ')"
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())'
  python3 -c 'import importlib.metadata as m
for d in ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine", "nixl-cu13", "pyzmq"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        pass'
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  [ -f "$engine_so" ] && ldd "$engine_so" | grep -E "not found|cudart|ibverbs|mlx5|numa|curl|libcuda"
  python3 -c 'import torch, mooncake.engine as e
from hawk.transport.mooncake_transport import _cuda_capable_build as c
print("mooncake engine", e.__file__, "cuda build:", c())'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
dec=1
[ "$ngpu" -lt 2 ] && dec=0  # one GPU: both roles on it (label the results so)
tag=h200x2
[ "$dec" = 0 ] && tag=h200x1

LOGS=${LOGS:-$OUT}
mkdir -p "$LOGS"
step() {
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log" | grep -vE "NIXL INFO|^I[0-9]{4} "
  echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"
}
have() { python3 -c "import torch, $1" > /dev/null 2>&1; }
bench() {  # bench TRANSPORT JSON SIZES REPEATS: sets B, the command line
  B=(python3 -m hawk.cli bench transfer --transport "$1" --prefill-device cuda:0 --npu-device "npu-emu:cuda:$dec"
    --gpu-decode-device "cuda:$dec" --sizes-mb "$3" --repeats "$4" --configs gg-direct,gn-hawk --json "$2")
}

if want tests; then
  if have mooncake.engine; then
    step mooncake_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mooncake_gpu.py
  else
    echo "=== mooncake_tests skipped: Mooncake's engine does not import (carry $WHL)"
  fi
fi
if want mooncake; then
  if have mooncake.engine; then
    bench mooncake "$OUT/transfer_mooncake_$tag.json" 10,80,320,1280 10
    HAWK_MOONCAKE_PROTOCOL=nvlink_intra step transfer_mooncake 210 "${B[@]}"
  else
    echo "=== transfer_mooncake skipped: Mooncake's engine does not import (carry $WHL)"
  fi
fi
if want nixl; then
  if have nixl; then
    bench nixl "$OUT/transfer_nixl_$tag.json" 10,80,320,1280 10
    step transfer_nixl 200 "${B[@]}"
  else
    echo "=== transfer_nixl skipped: NIXL's wheels are neither in $WHL nor in .whl"
  fi
fi
if want tcp && have mooncake.engine; then
  bench mooncake "$OUT/transfer_mooncake_tcp_$tag.json" 10,80 3
  HAWK_MOONCAKE_PROTOCOL=tcp step transfer_mooncake_tcp 150 "${B[@]}"
fi
exit 0
