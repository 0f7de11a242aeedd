"""Does a shadow's first adoption pay CUDA's lazy module loading? Times the device ops an
adoption runs (``kv_hooks/belayer_kv_adopt.warm_kernels``, on tiny tensors) in a fresh CUDA
process: the first call against the second, with CUDA's default lazy module loading and with
``CUDA_MODULE_LOADING=EAGER`` (each a child process). JSON in benchmarks/results/.

    python3 benchmarks/adopt_kernel_warmup.py --device cuda:0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HOOKS = Path(__file__).resolve().parents[1] / "belayer_engine" / "backends" / "sglang" / "kv_hooks"


def child(device: str) -> None:
    sys.path.insert(0, str(HOOKS))
    import torch
    from belayer_kv_adopt import warm_kernels

    torch.zeros(1, device=device)  # the context exists, as in a started server
    torch.cuda.synchronize(device)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        warm_kernels(device)
        times.append(1e3 * (time.perf_counter() - t0))
    print(json.dumps({"ms": times, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device)}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if args.child:
        return child(args.device)
    result = {"question": "the adoption's device ops: first call vs later ones, lazy vs eager module loading"}
    for loading in ("LAZY", "EAGER"):
        env = {**os.environ, "CUDA_MODULE_LOADING": loading}
        out = subprocess.run([sys.executable, __file__, "--child", "--device", args.device], env=env,
                             capture_output=True, text=True, timeout=300)
        result[loading] = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
        print(loading, result[loading], flush=True)
    path = Path(args.out) / "adopt_kernel_warmup_cuda.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
