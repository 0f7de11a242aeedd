"""How the GRPO loss is averaged decides whether the demo's reward rises: per episode vs per token.

The demo's learning loop (same tasks, expert warm start, ``Learner``, 8 steps of 8 tasks x 4
samples) with the two things that make a demo run slow replaced: episodes are sampled
straight from the learner's model (batched, no engine) and commands run in host temp dirs
with ``bash`` (no containers; the observations have the env's format). Many seeds of each
weighting run side by side, so one run shows the effect instead of one noisy curve.

    python benchmarks/grpo_loss_weighting.py --seeds 6 --parallel 2       # CPU, ~20 min on 2 cores
    python benchmarks/grpo_loss_weighting.py --seeds 13 --device cuda --parallel 16

Writes benchmarks/results/grpo_loss_weighting.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._plotting import save_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # belayer_env.env.recoverable.SUBMIT_MARKER (no Docker import here)
OBSERVATION = "<returncode>{returncode}</returncode>\n<output>\n{output}</output>"


class HostShell:
    """A task's repo in a temp dir; ``step`` runs one command the way the env would."""

    def __init__(self, task):
        self.task, self.dir = task, tempfile.mkdtemp(prefix="belayer-grpo-")
        for name, text in task.files.items():
            Path(self.dir, name).write_text(text)
        bin_dir = Path(self.dir, ".bin")
        bin_dir.mkdir()
        (bin_dir / "submit").write_text(f"#!/bin/sh\necho {MARKER}\n")
        (bin_dir / "submit").chmod(0o755)
        self.path = f"{bin_dir}:/usr/bin:/bin"

    def step(self, action: str) -> tuple[str | None, float]:
        """(observation, 0.0), or (None, reward) once the agent submitted."""
        try:
            r = subprocess.run(["bash", "-c", action], cwd=self.dir, capture_output=True, text=True, timeout=5,
                               env={"PATH": self.path, "HOME": self.dir}, errors="replace")
            rc, out = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            rc, out = 124, ""
        lines = out.lstrip().splitlines()
        if rc == 0 and lines and lines[0].strip() == MARKER:
            test = subprocess.run(self.task.test_command.split(), cwd=self.dir, capture_output=True, timeout=10)
            return None, float(test.returncode == 0)
        return OBSERVATION.format(returncode=rc, output=out), 0.0

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _episodes(model, tasks, group: int, cfg: dict, gen, device: str):
    """``group`` episodes per task, all turns of all episodes sampled as one batch per turn."""
    import torch

    from belayer.examples.swe_rl.episode import Episode, Turn
    from belayer_engine.model.chat_template import apply_chat_template
    from belayer_engine.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    ends = set(tok.eos_token_ids)
    jobs = [t for t in tasks for _ in range(group)]
    shells = [HostShell(t) for t in jobs]
    chats = [[{"role": "user", "content": t.prompt}] for t in jobs]
    episodes = [Episode(task_id=t.id) for t in jobs]
    live = list(range(len(jobs)))
    for _turn in range(cfg["max_turns"]):
        if not live:
            break
        prompts = [tok.encode(apply_chat_template(chats[i])) for i in live]
        seqs, outs, active = [list(p) for p in prompts], [[] for _ in live], list(range(len(live)))
        with torch.no_grad():
            for _ in range(cfg["max_tokens"]):
                if not active:
                    break
                width = max(len(seqs[r]) for r in active)
                batch = torch.zeros((len(active), width), dtype=torch.long)
                for row, r in enumerate(active):
                    batch[row, : len(seqs[r])] = torch.tensor(seqs[r])
                logits = model(batch.to(device))
                last = torch.stack([logits[row, len(seqs[r]) - 1] for row, r in enumerate(active)]).float()
                nxt = torch.multinomial(torch.softmax(last / cfg["temperature"], -1).cpu(), 1, generator=gen)
                still = []
                for row, r in enumerate(active):
                    t = int(nxt[row])
                    outs[r].append(t)
                    seqs[r].append(t)
                    if t not in ends:
                        still.append(r)
                active = still
        survivors = []
        for k, i in enumerate(live):
            episodes[i].turns.append(Turn(prompt_ids=prompts[k], completion_ids=outs[k], weight_version=0))
            action = tok.decode(outs[k]).replace("\x00", "").strip() or "true"
            obs, reward = shells[i].step(action)
            if obs is None:
                episodes[i].reward = reward
                continue
            chats[i] += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
            survivors.append(i)
        live = survivors
    for s in shells:
        s.close()
    return [episodes[k * group:(k + 1) * group] for k in range(len(tasks))]


def _expert(tasks):
    from belayer.examples.swe_rl.episode import Episode, Turn
    from belayer.examples.swe_rl.expert import expert_actions
    from belayer_engine.model.chat_template import apply_chat_template
    from belayer_engine.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    out = []
    for task in tasks:
        shell, chat, ep = HostShell(task), [{"role": "user", "content": task.prompt}], Episode(task_id=task.id)
        for action in expert_actions(task):
            ep.turns.append(Turn(prompt_ids=tok.encode(apply_chat_template(chat)), weight_version=None,
                                 completion_ids=tok.encode(action) + [tok.special_ids["<|im_end|>"]]))
            obs, ep.reward = shell.step(action)
            if obs is None:
                break
            chat += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]
        shell.close()
        assert ep.reward == 1.0, f"expert failed on {task.id}"
        out.append(ep)
    return out


def one_run(weighting: str, seed: int, args: dict) -> dict:
    """One demo-shaped training run; returns the mean reward of each step's samples."""
    import torch

    from belayer.examples.swe_rl import learner as learner_mod
    from belayer.examples.swe_rl import policy
    from belayer.examples.swe_rl.config import LearnerConfig
    from belayer.examples.swe_rl.learner import Learner
    from belayer.examples.swe_rl.tasks import sample_tasks

    torch.set_num_threads(args["threads"])
    device = args["device"]
    if device != "cpu":  # the learner builds its index tensors on the CPU: move the batch
        def logprobs_on_device(model, seqs, pad_id=0, temperature=1.0):
            width = max(len(ids) for ids, _ in seqs)
            batch = torch.full((len(seqs), width), pad_id, dtype=torch.long)
            for i, (ids, _) in enumerate(seqs):
                batch[i, : len(ids)] = torch.tensor(ids)
            logp = torch.log_softmax(model(batch.to(device)).float() / temperature, dim=-1)
            out = []
            for i, (ids, spans) in enumerate(seqs):
                pos = torch.tensor([p for a, b in spans for p in range(a - 1, b - 1)], device=device)
                tgt = torch.tensor([ids[p] for a, b in spans for p in range(a, b)], device=device)
                out.append(logp[i, pos, tgt])
            return out

        learner_mod.sequence_logprobs = policy.sequence_logprobs = logprobs_on_device
    tasks = sample_tasks(8, 0)
    learner = Learner(LearnerConfig(rl_lr=args["lr"], loss_agg=weighting))
    if device != "cpu":
        learner.model.to(device)
        learner.opt = learner._new_optimizer()
    learner.sft(_expert(tasks))
    gen = torch.Generator().manual_seed(seed)
    cfg = {"max_turns": 4, "max_tokens": 48, "temperature": 1.0}
    rewards = []
    for step in range(1, args["steps"] + 1):
        chosen = random.Random(step).sample(tasks, 8)  # the demo's task draw (trainer.py, seed 0)
        groups = _episodes(learner.model, chosen, 4, cfg, gen, device)
        rewards.append(round(statistics.fmean(e.reward for g in groups for e in g), 4))
        learner.grpo_step(groups)
    return {"weighting": weighting, "seed": seed, "rewards": rewards}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6, help="sampling seeds per weighting (default 6)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4, help="RL learning rate (the demo's: 3e-4)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--parallel", type=int, default=2, help="runs at a time (processes)")
    ap.add_argument("--out", default=str(RESULTS / "grpo_loss_weighting.json"))
    ap.add_argument("--replot", action="store_true", help="only redraw the plot of an existing --out JSON")
    args = ap.parse_args()
    if args.replot:
        _plot(json.loads(Path(args.out).read_text()), Path(args.out).with_suffix(".png"))
        return 0
    shared = {"steps": args.steps, "lr": args.lr, "device": args.device,
              "threads": max(1, (os.cpu_count() or 2) // args.parallel)}
    jobs = [(w, s) for s in range(args.seeds) for w in ("episode", "token")]
    runs, t0 = [], time.monotonic()
    with ProcessPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(one_run, w, s, shared) for w, s in jobs]
        for n, fut in enumerate(as_completed(futures), 1):
            run = fut.result()
            runs.append(run)
            print(f"[{n}/{len(jobs)}] {run['weighting']:7s} seed {run['seed']:2d}: "
                  f"{' '.join(f'{r:.2f}' for r in run['rewards'])}  ({time.monotonic() - t0:.0f}s)", flush=True)
    summary = {}
    for w in ("episode", "token"):
        mine = [r["rewards"] for r in runs if r["weighting"] == w]
        summary[w] = {"runs": len(mine),
                      "mean_by_step": [round(statistics.fmean(c), 4) for c in zip(*mine, strict=True)],
                      "rose": sum(r[-1] > r[0] for r in mine),
                      "collapsed": sum(r[-1] <= 0.05 for r in mine)}
    result = {"config": {**vars(args), "tasks": 8, "tasks_per_step": 8, "group_size": 4},
              "summary": summary, "runs": sorted(runs, key=lambda r: (r["weighting"], r["seed"]))}
    print(json.dumps(summary, indent=1))
    save_result(result, args.out, _plot)
    return 0


def _plot(result: dict, path: Path) -> None:
    from benchmarks._plotting import pyplot

    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for w, color in (("episode", "tab:green"), ("token", "tab:gray")):
        for r in (r for r in result["runs"] if r["weighting"] == w):
            ax.plot(range(1, len(r["rewards"]) + 1), r["rewards"], color=color, alpha=0.2, lw=1)
        s = result["summary"][w]
        ax.plot(range(1, len(s["mean_by_step"]) + 1), s["mean_by_step"], color=color, lw=2.5,
                label=f"per-{w} mean ({s['rose']}/{s['runs']} seeds rose)")
    ax.set(xlabel="GRPO step", ylabel="reward (tests pass)", ylim=(-0.02, 1.02),
           title=f"GRPO loss weighting, rl_lr {result['config']['lr']:g} (thin: single seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
