#!/usr/bin/env bash
# On the GPU machine, from the repository root (the SGLang bundle carried in build/): the
# handover_at_scale benchmark on the Qwen3-4B shape (random bf16 weights, written once per
# machine), results and logs into $OUT (or benchmarks/results). Arguments go to the benchmark.
#   bash benchmarks/scale_gpu_run.sh --modes adopt --cells 128x1,8192x16 --tag h100_adopt
set -euo pipefail
OUTDIR=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/gpu.txt"
MODEL=$(bash benchmarks/sglang_gpu_env.sh python3 -c "from belayer_engine.backends.sglang.model_dir import ensure_embedded_model as e; from belayer_engine.model.config import ModelConfig as M; print(e(cfg=M.qwen3_4b()))" | tail -1)
echo "model: $MODEL"
exec bash benchmarks/sglang_gpu_env.sh python3 benchmarks/handover_at_scale.py --device cuda:0 --model-dir "$MODEL" \
  --vocab 151936 --out "$OUTDIR" "$@"
