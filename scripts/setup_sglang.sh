#!/usr/bin/env bash
# Install SGLang into its own virtual environment, so that SGLang's pins (torch 2.14.1 CUDA,
# transformers, ...) never touch the project's environment. CPU machines: SGLang 0.5.23 over
# the CPU build of torch 2.13.0; sglang is installed with --no-deps and its runtime
# dependencies by name, which keeps the multi-GB CUDA torch out (see
# shared/notes/sglang-cpu.md). What the CPU path needs beyond SGLang's own packages (the
# kernel-package stand-in) ships in belayer_engine/backends/sglang/cpu_shims/ and is put on
# the server's PYTHONPATH by the launcher, not installed here.
#
# Idempotent: a stamp file records what was installed; a re-run on a ready machine only
# checks the stamp and imports nothing heavy (a second or so).
# Environment knobs:
#   BELAYER_SGLANG_VENV    venv folder (default: /opt/belayer/sglang-venv)
#   BELAYER_SGLANG_PYTHON  python that creates the venv (default: python3)
set -euo pipefail

VENV=${BELAYER_SGLANG_VENV:-/opt/belayer/sglang-venv}
PY=${BELAYER_SGLANG_PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
# SGLang's runtime dependencies, by name (pins where SGLang 0.5.23 pins them; pyyaml reads
# the --config file that carries the worker secret).
DEPS=(
  numpy fastapi uvicorn uvloop pydantic orjson pyzmq "transformers==5.19.0" "tokenizers==0.23.2"
  safetensors psutil requests aiohttp msgspec setproctitle pybase64 partial_json_parser
  python-multipart prometheus-client xxhash interegular einops tqdm packaging pillow
  "triton==3.6.0" zstandard IPython dill apache-tvm-ffi sentencepiece compressed-tensors gguf
  openai jsonschema "xgrammar==0.2.7" "soundfile==0.13.1" pyyaml
)
STAMP_TEXT="sglang==$SGLANG_VERSION torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION ${DEPS[*]}"
STAMP=$VENV/.belayer-sglang-stamp
LOG_DIR=${BELAYER_LOG_DIR:-/var/log/belayer}
mkdir -p "$LOG_DIR"

# step/info/die, run_logged
. "$(cd "$(dirname "$0")" && pwd)/lib.sh"
# run_logged that first says what it runs and where its log goes
run_logged_said() { info "${*:2} (log: $1)"; run_logged "$@"; }

step "SGLang $SGLANG_VERSION in $VENV"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] && [ -x "$VENV/bin/python" ]; then
  info "ready (stamp matches)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || run_logged_said "$LOG_DIR/sglang-venv.log" "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)
# Keeps every later step from replacing the CPU torch with PyPI's CUDA build.
CONSTRAINTS=$VENV/belayer-constraints.txt
printf 'torch==%s\ntorchvision==%s\n' "$TORCH_VERSION" "$TORCHVISION_VERSION" >"$CONSTRAINTS"
run_logged_said "$LOG_DIR/sglang-torch.log" "${PIP[@]}" -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
run_logged_said "$LOG_DIR/sglang-sglang.log" "${PIP[@]}" -c "$CONSTRAINTS" --no-deps \
  "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
run_logged_said "$LOG_DIR/sglang-deps.log" "${PIP[@]}" -c "$CONSTRAINTS" "${DEPS[@]}"
"$VENV/bin/python" - <<'PYEOF' || die "torch in the SGLang venv is not the CPU build"
import torch
assert not torch.version.cuda, torch.version.cuda
print("    torch", torch.__version__, "(CPU)")
PYEOF
"$VENV/bin/python" -c 'import importlib.metadata as m; print("    sglang", m.version("sglang"))'
printf '%s' "$STAMP_TEXT" >"$STAMP"
info "done"
