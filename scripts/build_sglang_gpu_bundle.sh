#!/usr/bin/env bash
# Build a small bundle of slimmed wheels that runs SGLang on a GPU machine whose image
# already has torch 2.11 (cu130), triton, numpy, requests, huggingface-hub and safetensors
# but no network (the H200 machine of shared/notes/sglang-gpu.md). SGLang 0.5.17 matches
# torch 2.11 (0.5.22+ need torch 2.14's c10 symbols). Slimming (verified there):
#   - sglang-kernel 0.4.5: drop flash_ops (FA3, ~1.1 GB unpacked; imported only by
#     sgl_kernel/flash_attn.py), sm100 and the infllm/flashmla ops: serve with
#     --attention-backend triton on sm90
#   - sglang 0.5.17: drop its three Rust _core extension modules
#   - flashinfer 0.6.15.post1: drop data/cutlass and data/cccl only (its norm JIT needs
#     data/csrc and data/include; the whole wheel ran there, this slim one compiled the norm
#     kernel with nvcc 13.0 on a CPU machine)
# Output: OUT (default build/sglang-gpu-bundle/) with the wheels, OUT-extra with aiohttp and
# its small dependencies (the engine's own) and torch_memory_saver, and OUT.tar.xz: every
# wheel of both unpacked into one folder `sgl/`, packed with xz (~42 MiB: with the project it
# fits the 64 MiB one device call carries). openai stays below 2 (the newest imports httpx2).
# On the device: `bash benchmarks/sglang_gpu_env.sh CMD...` unpacks it once into /tmp/sgl,
# compiles it, and runs CMD with SGLang's environment.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/build/sglang-gpu-bundle}
DL=${BELAYER_WHEEL_CACHE:-$ROOT/build/wheel-cache}
mkdir -p "$OUT" "$DL"
PLATFORM=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
          --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform any)
WHEELS=(
  sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1
  transformers==5.12.1 tokenizers==0.22.2 apache-tvm-ffi "pydantic==2.14.*" pydantic-core fastapi starlette
  typing_inspection annotated_types uvicorn pyzmq orjson msgspec pybase64 setproctitle partial_json_parser python-multipart
  interegular dill compressed-tensors gguf loguru jsonschema referencing rpds-py
  jsonschema-specifications xgrammar==0.2.7 soundfile cffi pycparser "openai==1.109.1" jiter distro sniffio
  "typing_extensions>=4.16" annotated-doc opentelemetry-api ipython traitlets pygments decorator
  matplotlib-inline prompt_toolkit wcwidth stack_data executing asttokens pure_eval pexpect
  ptyprocess ipython-pygments-lexers
)
# Exactly the wheels this list resolves to, in a fresh folder (the cache may hold other
# versions of the same package: two versions unpacked into one folder would mix files).
PICKED=$(mktemp -d)
trap 'rm -rf "$PICKED"' EXIT
echo "==> downloading ${#WHEELS[@]} wheels (py3.12 manylinux x86_64; cache $DL)"
pip download --disable-pip-version-check -q --no-deps "${PLATFORM[@]}" --find-links "$DL" -d "$PICKED" "${WHEELS[@]}"
cp -n "$PICKED"/*.whl "$DL"/
echo "==> slimming into $OUT"
rm -f "$OUT"/*.whl
python3 - "$PICKED" "$OUT" "${WHEELS[@]}" <<'PYEOF'
import re
import sys
import zipfile
from pathlib import Path

dl, out, wanted = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
DROP = {
    "sglang_kernel": re.compile(r"^sgl_kernel/(flash_ops|infllm_ops|flashmla_ops)[^/]*\.so$|^sgl_kernel/sm100/"),
    "sglang": re.compile(r"^sglang/srt/(server|grpc|multimodal)/_core\.[^/]*\.so$"),
    "flashinfer_python": re.compile(r"^flashinfer/data/(cutlass|cccl)/"),
}
def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()
names = {norm(re.split(r"[=<>]", w)[0]) for w in wanted}
total = 0
for whl in sorted(dl.glob("*.whl")):
    dist = norm(whl.name.split("-")[0])
    if dist not in names:
        continue
    drop = DROP.get(dist)
    target = out / whl.name
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if drop is not None and drop.search(info.filename):
                continue
            dst.writestr(info, src.read(info.filename))
    total += target.stat().st_size
print(f"    {len(list(out.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")
PYEOF

EXTRA=${OUT%/}-extra
mkdir -p "$EXTRA"
echo "==> aiohttp and its dependencies (the engine's own), torch_memory_saver (the shadow's"
echo "    memory saver: abi3, cu12 + cu13 hooks) into $EXTRA"
pip download --disable-pip-version-check -q --no-deps "${PLATFORM[@]}" -d "$EXTRA" \
  aiohttp multidict yarl frozenlist aiosignal propcache aiohappyeyeballs attrs torch_memory_saver==0.0.10
echo "    $(ls "$EXTRA" | wc -l) wheels, $(du -sm "$EXTRA" | cut -f1) MiB"

PACK=${OUT%/}.tar.xz
echo "==> one archive for one device call: $PACK"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/sgl"
for whl in "$OUT"/*.whl "$EXTRA"/*.whl; do python3 -m zipfile -e "$whl" "$STAGE/sgl"; done
tar -C "$STAGE" -cf - sgl | xz -T0 -6 > "$PACK.tmp" && mv "$PACK.tmp" "$PACK"
echo "    $(du -sm "$PACK" | cut -f1) MiB"
