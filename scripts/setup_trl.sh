#!/usr/bin/env bash
# Install TRL (the trainer belayer/examples/trl_grpo.py runs GRPO with, and
# tests/belayer/examples/test_trl_grpo.py runs in CI) into its own virtual environment, so that its
# pins (transformers, accelerate, datasets, pyarrow, ...) never touch the project's
# environment.
#
# The venv sees the project's packages (--system-site-packages) and is installed under a
# constraint on every package the project's environment holds, at the version it holds
# (torch 2.13.0 CPU among them: never a CUDA torch): pip adds only packages the project
# lacks and changes none it has (or fails here, naming the conflict). One exception,
# RELAXED below: datasets (TRL's dependency) caps fsspec below the project's, so the venv
# gets its own older fsspec, seen first by the venv's python only; the project's
# environment keeps its own. The example runs with this venv's python:
# `$VENV/bin/python -m belayer.examples.trl_grpo`.
#
# Idempotent: a stamp records the version and the project's package set it was resolved
# against; a re-run on a ready machine compares it and exits (a second or so). A change to
# the project's environment re-resolves (pip keeps what still fits).
# Environment knobs:
#   BELAYER_TRL_VENV   venv folder (default: /opt/belayer/trl-venv)
#   BELAYER_PYTHON     the project's python (default: python3)
set -euo pipefail

VENV=${BELAYER_TRL_VENV:-/opt/belayer/trl-venv}
PY=${BELAYER_PYTHON:-python3}
VERSION=1.16.0
LOG_DIR=${BELAYER_LOG_DIR:-/var/log/belayer}
mkdir -p "$LOG_DIR"

# step/info/die, run_logged
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"

step "TRL $VERSION in $VENV (test dependency)"
# packages the venv may hold at another version than the project's (in the venv only)
RELAXED="fsspec"
CONSTRAINTS_TEXT=$(project_constraints $RELAXED)
STAMP_TEXT="trl==$VERSION $(printf '%s' "$CONSTRAINTS_TEXT" | sha256sum | cut -c1-16)"
STAMP=$VENV/.belayer-trl-stamp
if side_venv_ready "$VENV" "$STAMP" "$STAMP_TEXT"; then
  info "ready (stamp matches)"
  exit 0
fi
CONSTRAINTS=$VENV/project-constraints.txt
printf '%s\n' "$CONSTRAINTS_TEXT" >"$CONSTRAINTS"
info "pip install trl==$VERSION, the project's packages held (log: $LOG_DIR/trl.log; ~2 min the first time)"
run_logged "$LOG_DIR/trl.log" "$VENV/bin/python" -m pip install --disable-pip-version-check \
  --progress-bar off -c "$CONSTRAINTS" "trl==$VERSION"
"$VENV/bin/python" -c 'import torch, trl, transformers; from trl import GRPOConfig, GRPOTrainer; print("    trl", trl.__version__, "transformers", transformers.__version__, "torch", torch.__version__)' \
  || die "TRL does not import in $VENV"
printf '%s' "$STAMP_TEXT" >"$STAMP"
info "done"
