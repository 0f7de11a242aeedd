#!/usr/bin/env bash
# Install AReaL 1.0.4 (whose own SGLang client tests/belayer/wrappers/test_areal.py drives the engine
# with) into its own virtual environment, so that its pins (torch<2.11, vllm, megatron, ...)
# never touch the project's environment.
#
# AReaL's full dependency set is a GPU training stack (gigabytes); the test needs only its
# remote SGLang client (areal.engine.sglang_remote). So AReaL is installed with --no-deps, and
# only what that module imports is installed by name, at the versions it was tested with. The
# venv sees the project's packages (--system-site-packages: torch, numpy, aiohttp, requests,
# ray, ... are not installed twice); whatever is installed here goes into the venv alone.
#
# Idempotent: a stamp records what was installed; a re-run on a ready machine compares it
# and exits (a second or so).
# Environment knobs:
#   BELAYER_AREAL_VENV  venv folder (default: /opt/belayer/areal-venv)
#   BELAYER_PYTHON      the project's python, which creates the venv (default: python3)
set -euo pipefail

VENV=${BELAYER_AREAL_VENV:-/opt/belayer/areal-venv}
PY=${BELAYER_PYTHON:-python3}
VERSION=1.0.4
# What `import areal.engine.sglang_remote` needs beyond the project's packages (2026-12-03).
DEPS=(
  "httpx==0.29.0" "colorlog==6.12.0" "tenacity==9.2.1" "torchdata==0.11.0" "lark==1.3.1"
  "uvloop==0.23.0" "hydra-core==1.3.8" "omegaconf==2.3.1" "transformers==5.25.0"
  "tokenizers==0.23.3" "huggingface_hub==2.4.0" "numba==0.68.1" "einops==0.8.2"
  "aiofiles==25.1.0" "pybase64==1.5.1"
)
STAMP_TEXT="areal==$VERSION ${DEPS[*]}"
STAMP=$VENV/.belayer-areal-stamp
LOG_DIR=${BELAYER_LOG_DIR:-/var/log/belayer}
mkdir -p "$LOG_DIR"

# step/info/die, run_logged
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"

step "AReaL $VERSION in $VENV (test dependency: its SGLang client)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && [ -x "$VENV/bin/python" ]; then
  info "ready (stamp matches)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
info "pip install --no-deps areal==$VERSION, then its client's imports (log: $LOG_DIR/areal.log)"
run_logged "$LOG_DIR/areal.log" "${PIP[@]}" --no-deps "areal==$VERSION"
run_logged "$LOG_DIR/areal-deps.log" "${PIP[@]}" "${DEPS[@]}"
"$VENV/bin/python" -c "import areal.engine.sglang_remote" || die "AReaL's SGLang client does not import in $VENV"
printf '%s' "$STAMP_TEXT" >"$STAMP"
info "done"
