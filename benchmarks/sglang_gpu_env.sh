#!/usr/bin/env bash
# On the GPU machine, from the repository root: run "$@" with the SGLang bundle of
# scripts/build_sglang_gpu_bundle.sh as SGLang's environment. The first call unpacks
# build/sglang-gpu-bundle.tar.xz into $BELAYER_SGLANG_DIR (default /tmp/sgl) and compiles it
# (~30 s); later calls on the same machine reuse it.
#   bash benchmarks/sglang_gpu_env.sh python3 benchmarks/engine_handover.py --backend sglang --device cuda:0 ...
set -euo pipefail
SGL=${BELAYER_SGLANG_DIR:-/tmp/sgl}
PACK=${BELAYER_SGLANG_BUNDLE:-build/sglang-gpu-bundle.tar.xz}
if [ ! -f "$SGL/.unpacked" ]; then
  [ -f "$PACK" ] || { echo "no $PACK: run scripts/build_sglang_gpu_bundle.sh where pip works, carry the file" >&2; exit 2; }
  mkdir -p "$SGL"
  t0=$(date +%s)
  xz -dc -T0 "$PACK" | tar -C "$SGL" --strip-components=1 -xf -
  python3 -m compileall -q "$SGL" >/dev/null 2>&1 || true
  touch "$SGL/.unpacked"
  echo "sglang_gpu_env: unpacked and compiled $PACK into $SGL in $(( $(date +%s) - t0 )) s" >&2
fi
# SGLang's "venv": a wrapper, not a symlink (the image's python3 lives in a venv whose
# packages, numpy among them, a symlink would lose).
VENV=${BELAYER_SGLANG_VENV:-/tmp/sglvenv}
mkdir -p "$VENV/bin"
printf '#!/bin/sh\nexec python3 "$@"\n' > "$VENV/bin/python"
chmod 755 "$VENV/bin/python"
export BELAYER_SGLANG_VENV=$VENV BELAYER_SGLANG_PYTHONPATH=$SGL PYTHONPATH=$PWD:$SGL PYTHONUNBUFFERED=1
exec "$@"
