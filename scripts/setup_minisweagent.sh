#!/usr/bin/env bash
# Install mini-swe-agent (the real agent that tests/belayer/wrappers/test_minisweagent_real.py runs
# Belayer's adapter under) into its own virtual environment, so that its pins (litellm,
# datasets, ...) never touch the project's environment.
#
# The venv sees the project's packages (--system-site-packages) and is installed under a
# constraint on every package the project's environment holds, at the version it holds: pip
# adds only packages the project lacks and changes none it has (or fails here, naming the
# conflict). So the test process can put the venv's site-packages after its own
# (tests/belayer/wrappers/extra_deps.py) and import both the project and mini-swe-agent, each at the
# versions it was tested with; `$VENV/bin/python -m pytest ...` works too.
#
# Idempotent: a stamp records the version and the project's package set it was resolved
# against; a re-run on a ready machine compares it and exits (a second or so). A change to
# the project's environment re-resolves (pip keeps what still fits).
# Environment knobs:
#   BELAYER_MINISWEAGENT_VENV  venv folder (default: /opt/belayer/minisweagent-venv)
#   BELAYER_PYTHON             the project's python (default: python3)
set -euo pipefail

VENV=${BELAYER_MINISWEAGENT_VENV:-/opt/belayer/minisweagent-venv}
PY=${BELAYER_PYTHON:-python3}
VERSION=2.4.6
LOG_DIR=${BELAYER_LOG_DIR:-/var/log/belayer}
mkdir -p "$LOG_DIR"

# step/info/die, run_logged
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"

step "mini-swe-agent $VERSION in $VENV (test dependency)"
CONSTRAINTS_TEXT=$(project_constraints)
STAMP_TEXT="mini-swe-agent==$VERSION $(printf '%s' "$CONSTRAINTS_TEXT" | sha256sum | cut -c1-16)"
STAMP=$VENV/.belayer-minisweagent-stamp
if side_venv_ready "$VENV" "$STAMP" "$STAMP_TEXT"; then
  info "ready (stamp matches)"
  exit 0
fi
CONSTRAINTS=$VENV/project-constraints.txt
printf '%s\n' "$CONSTRAINTS_TEXT" >"$CONSTRAINTS"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -c "$CONSTRAINTS")
# What this resolved to against the project's packages (2026-12-03), tried first: left to
# itself pip downloads some 200 releases of litellm and datasets before it finds them (~10 min).
HINTS=("litellm==1.83.0" "datasets==2.14.4" "huggingface-hub==0.36.2" "multiprocess==0.70.15")
info "pip install mini-swe-agent==$VERSION, the project's packages held (log: $LOG_DIR/minisweagent.log)"
if ! (run_logged "$LOG_DIR/minisweagent.log" "${PIP[@]}" "mini-swe-agent==$VERSION" "${HINTS[@]}") 2>/dev/null; then
  info "the hinted versions no longer fit: resolving without them (minutes)"
  run_logged "$LOG_DIR/minisweagent.log" "${PIP[@]}" "mini-swe-agent==$VERSION"
fi
MSWEA_SILENT_STARTUP=1 MSWEA_GLOBAL_CONFIG_DIR=$VENV/mswea-config "$VENV/bin/python" -c \
  'import minisweagent.agents.interactive, minisweagent.models.test_models, minisweagent; print("    mini-swe-agent", minisweagent.__version__)' \
  || die "mini-swe-agent does not import in $VENV"
printf '%s' "$STAMP_TEXT" >"$STAMP"
info "done"
