#!/usr/bin/env bash
# Install sglang-router 0.3.2 (the router people run in front of SGLang servers, which
# benchmarks/router_failover.py measures beside Belayer's `belayer serve router`) into the SGLang
# venv that scripts/setup_sglang.sh made. Its dependencies (setproctitle, aiohttp, orjson,
# uvicorn, fastapi) are SGLang's own; the venv's torch constraint keeps the CPU torch in place.
# Its Python launcher imports SGLang, which on a CPU machine needs the project's stand-ins on
# PYTHONPATH (belayer_engine/backends/sglang/cpu_shims, as the SGLang servers get them).
#
# Idempotent: when sglang-router is installed at this version it only checks that.
# Environment knobs:
#   BELAYER_SGLANG_VENV  the SGLang venv (default: /opt/belayer/sglang-venv)
set -euo pipefail

VENV=${BELAYER_SGLANG_VENV:-/opt/belayer/sglang-venv}
VERSION=0.3.2
LOG_DIR=${BELAYER_LOG_DIR:-/var/log/belayer}
mkdir -p "$LOG_DIR"

# step/info/die, run_logged
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"

step "sglang-router $VERSION in $VENV (benchmark dependency)"
[ -x "$VENV/bin/python" ] || die "no SGLang venv at $VENV: run scripts/setup_sglang.sh first"
if [ "$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang-router"))' 2>/dev/null)" = "$VERSION" ]; then
  info "installed"
  exit 0
fi
CONSTRAINTS=$VENV/belayer-constraints.txt
run_logged "$LOG_DIR/sglang-router.log" "$VENV/bin/python" -m pip install --disable-pip-version-check \
  --progress-bar off $([ -f "$CONSTRAINTS" ] && echo -c "$CONSTRAINTS") "sglang-router==$VERSION"
"$VENV/bin/python" -c 'import sglang_router.sglang_router_rs' || die "sglang-router's Rust core does not import in $VENV"
info "done"
