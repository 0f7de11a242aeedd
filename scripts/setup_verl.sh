#!/usr/bin/env bash
# Install verl 0.9.1 (whose own agent-loop code tests/belayer/wrappers/test_verl.py runs
# belayer/wrappers/verl/ under) into its own virtual environment, so that its pins
# (transformers<5.11, tensordict<=0.10, hydra's omegaconf 2.3, ...) never touch the project's
# environment.
#
# verl's full dependency set is a GPU training stack (wandb, peft, accelerate, vllm/sglang
# extras, ...); the agent-loop path (verl.experimental.agent_loop, its worker, the Continuous
# Token builder, DataProto) needs a few packages. So verl is installed with --no-deps and only
# what that path imports is installed by name, at the versions it was tested with (2026-12-05;
# `python -c "import verl.experimental.agent_loop"` fails on the first one missing). The venv
# sees the project's packages (--system-site-packages: torch 2.13.0 CPU, numpy, ray, aiohttp,
# pydantic ... are not installed twice) and is resolved under a constraint on every package the
# project's environment holds, at the version it holds, except RELAXED below, which verl's pins
# need older in the venv only (hydra-core 1.3 wants omegaconf 2.3 and antlr4 4.9, tensordict
# 0.10's pyvers wants packaging<26, datasets wants an older fsspec); the project keeps its own.
#
# Idempotent: a stamp records what was installed against which project package set; a re-run
# on a ready machine compares it and exits (a second or so).
# Environment knobs:
#   BELAYER_VERL_VENV  venv folder (default: /opt/belayer/verl-venv)
#   BELAYER_PYTHON     the project's python, which creates the venv (default: python3)
set -euo pipefail

VENV=${BELAYER_VERL_VENV:-/opt/belayer/verl-venv}
PY=${BELAYER_PYTHON:-python3}
VERSION=0.9.1
DEPS=(
  "tensordict==0.10.0" "hydra-core==1.3.2" "omegaconf==2.3.0" "antlr4-python3-runtime==4.9.3"
  "transformers==5.10.4" "tokenizers==0.22.2" "huggingface_hub==1.21.0" "datasets==5.0.1"
  "fsspec==2026.6.0" "packaging==25.0" "codetiming==1.4.0" "cachetools==8.0.3" "uvicorn==0.55.0"
  "fastapi==0.165.0"
)
RELAXED="omegaconf antlr4-python3-runtime packaging fsspec"
LOG_DIR=${BELAYER_LOG_DIR:-/var/log/belayer}
mkdir -p "$LOG_DIR"

# step/info/die, run_logged, project_constraints
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"

step "verl $VERSION in $VENV (test dependency: its agent-loop path)"
CONSTRAINTS_TEXT=$(project_constraints $RELAXED)
STAMP_TEXT="verl==$VERSION ${DEPS[*]} $(printf '%s' "$CONSTRAINTS_TEXT" | sha256sum | cut -c1-16)"
STAMP=$VENV/.belayer-verl-stamp
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && [ -x "$VENV/bin/python" ]; then
  info "ready (stamp matches)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
CONSTRAINTS=$VENV/project-constraints.txt
printf '%s\n' "$CONSTRAINTS_TEXT" >"$CONSTRAINTS"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
info "pip install --no-deps verl==$VERSION, then its agent loop's imports (log: $LOG_DIR/verl.log)"
run_logged "$LOG_DIR/verl.log" "${PIP[@]}" --no-deps "verl==$VERSION"
run_logged "$LOG_DIR/verl-deps.log" "${PIP[@]}" -c "$CONSTRAINTS" "${DEPS[@]}"
"$VENV/bin/python" - <<'PYEOF' || die "verl's agent loop does not import in $VENV"
import torch, verl
import verl.experimental.agent_loop  # noqa: F401
assert not torch.version.cuda, torch.version.cuda
print("    verl", verl.__version__, "torch", torch.__version__, "(CPU)")
PYEOF
printf '%s' "$STAMP_TEXT" >"$STAMP"
info "done"
