"""SIGKILL a worker mid-stream; count the tokens generated twice: token-level recovery vs
the coarse every-k scheme.

Token-level recovery (the router's default) continues a killed stream from the last token
the client has; the every-k scheme (``RouterConfig(recovery="chunk")``) restarts from the
last multiple of ``--chunk-tokens`` and regenerates the tail. One engine per scheme, a
shadow per slot; ``--repeats`` kills each at a random token in
[``chunk_tokens / 2``, ``max_tokens - 16``]. Writes JSON and a plot to ``benchmarks/results/``.

    python benchmarks/engine_regeneration.py                          # CPU, embedded small model
    python benchmarks/engine_regeneration.py --device cuda:0 --model-dir DIR --repeats 2

``regenerated`` per kill is the router's count; ``diverged``: the regenerated tail differed
from what the client already had, so the router switched that request to token-level
(bf16 re-prefill on a GPU is not bit-exact), never sending a token twice.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
from pathlib import Path

from _handover_common import add_engine_args, backend_kwargs, result_tag, stream_with_kill

from belayer_engine.engine import RecoverableEngine
from belayer_engine.router import RouterConfig

SCHEMES = ("token", "chunk")


def regenerated(args, rng: random.Random) -> dict:
    """Per scheme, one record per kill: where it failed, how many tokens were regenerated."""
    out = {}
    for recovery in SCHEMES:
        router = RouterConfig(recovery=recovery, chunk_tokens=args.chunk_tokens)
        vals = out[recovery] = []
        with RecoverableEngine.launch(workers=1, shadow=True, device=args.device, model=args.model_dir, router=router,
                                      unhealthy_window_s=0.0, arena_args=args.arena_arg, start_timeout_s=600,
                                      **backend_kwargs(args)) as eng:
            for _ in range(args.repeats):
                eng.wait_ready(timeout=600, stable=True)
                kill_at = rng.randint(args.chunk_tokens // 2, args.max_tokens - 16)
                r = asyncio.run(stream_with_kill(eng.base_url, args.max_tokens, kill_at, eng.worker_pid(0)))
                vals.append({"failure_at_token": r["summary"]["failures"][0]["at_token"],
                             "regenerated": r["summary"]["regenerated_tokens"], "diverged": r["summary"].get("diverged")})
                print(recovery, json.dumps(vals[-1]), flush=True)
    return out


def plot(result: dict, path: Path) -> None:
    from _plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    regen = result["regenerated"]
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(["token-level", f"every {result['chunk_tokens']}"],
           [statistics.fmean(v["regenerated"] for v in regen[k]) for k in SCHEMES], color=["#4a4", "#c84"])
    ax.set_ylabel("tokens regenerated per failure (mean)")
    ax.set_title(f"recovery granularity ({result['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(p)
    p.add_argument("--repeats", type=int, default=3, help="kills per scheme")
    p.add_argument("--max-tokens", type=int, default=400)
    p.add_argument("--chunk-tokens", type=int, default=256, help="k of the every-k scheme")
    args = p.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.plot_only).read_text()), Path(args.plot_only).with_suffix(".png"))
        return
    if args.repeats < 1 or args.max_tokens - 16 < args.chunk_tokens // 2:
        p.error("needs --repeats >= 1 and --max-tokens - 16 >= --chunk-tokens / 2 (where the kill is drawn)")
    rng = random.Random(7)
    result = {"device": args.device, "backend": args.backend, "host": platform.node(), "cpus": os.cpu_count(),
              "chunk_tokens": args.chunk_tokens, "max_tokens": args.max_tokens, "model_dir": args.model_dir,
              "regenerated": regenerated(args, rng)}
    result["summary"] = {"regenerated_mean": {k: statistics.fmean(v["regenerated"] for v in result["regenerated"][k])
                                              for k in SCHEMES}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result_tag(args)
    (out / f"engine_regeneration_{tag}.json").write_text(json.dumps(result, indent=2))
    try:
        plot(result, out / f"engine_regeneration_{tag}.png")
    except ImportError as exc:  # e.g. no matplotlib on the GPU machine: use --plot-only later
        print(f"no plot: {exc}")
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
