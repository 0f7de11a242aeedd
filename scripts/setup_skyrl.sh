#!/usr/bin/env bash
# Install skyrl-gym (SkyRL's env interface, which belayer/wrappers/skyrl.py adapts to and
# tests/belayer/wrappers/test_skyrl.py tests against) as a test dependency of the project's python.
# Its dependencies are light (pandas, omegaconf, func_timeout, requests) and touch neither
# torch nor pydantic: it is installed under a constraint on every package the project's
# environment already holds, at the version it holds, so pip only adds packages (or fails
# here, naming the conflict); it changes none.
#
# Idempotent: when skyrl_gym is installed at this version it only checks that (a second).
# Environment knobs:
#   BELAYER_PYTHON   the project's python (default: python3)
set -euo pipefail

PY=${BELAYER_PYTHON:-python3}
VERSION=0.4.0
LOG_DIR=${BELAYER_LOG_DIR:-/var/log/belayer}
mkdir -p "$LOG_DIR"

# step/info/die, run_logged
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"

step "skyrl-gym $VERSION (test dependency)"
if [ "$("$PY" -c 'import importlib.metadata as m; print(m.version("skyrl-gym"))' 2>/dev/null)" = "$VERSION" ]; then
  info "installed"
  exit 0
fi
CONSTRAINTS=$(mktemp /tmp/belayer-constraints.XXXXXX)
trap 'rm -f "$CONSTRAINTS"' EXIT
project_constraints >"$CONSTRAINTS"
info "pip install skyrl-gym==$VERSION, the project's packages held (log: $LOG_DIR/skyrl-gym.log)"
run_logged "$LOG_DIR/skyrl-gym.log" "$PY" -m pip install --disable-pip-version-check --progress-bar off \
  -c "$CONSTRAINTS" "skyrl-gym==$VERSION"
"$PY" -c 'import skyrl_gym' || die "skyrl_gym does not import after install"
info "done"
