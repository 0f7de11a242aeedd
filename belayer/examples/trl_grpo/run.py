"""TRL's ``GRPOTrainer`` trains the embedded model; its rollouts are Belayer episodes.

- the model: the embedded HF-layout model (``ensure_embedded_model``: a small random
  Qwen3 with a byte-level ``tokenizer.json``), served by a ``RecoverableEngine`` (arena,
  worker, shadow, router) and loaded by transformers (``Qwen3ForCausalLM``) for TRL;
- rollouts: TRL's ``rollout_func`` (``Rollouts``) runs each prompt as a multi-turn
  episode (``episode.run_episode``) in a ``RecoverableSandboxEnv`` against the engine's
  native ``/generate``, and returns ``prompt_ids``, ``completion_ids``, ``logprobs`` (the
  engine's) and ``env_mask``; the reward is read from the sandbox (``tasks.FileReward``)
  and handed to TRL's reward function as an extra field;
- weights: after every optimizer step (``PushWeights``, a ``TrainerCallback``) the
  trainer's ``state_dict`` goes to the engine through its weight endpoint
  (``EngineWeights``); every sample records the weight versions its tokens came from;
- faults, real: container SIGKILLs while the model generates, worker SIGKILLs
  mid-generation (``episode.Plan``), per step.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from belayer.wrappers.infra_policy import drop_mask

from .episode import EpisodeConfig, Plan, Sample, run_episode
from .tasks import BY_PROMPT, TASKS
from .warmstart import expert_ids, expert_sequence, warm_start

SETUP_HINT = ("TRL runs from its own venv: `bash scripts/setup_trl.sh` (part of `bash scripts/setup.sh`), "
              "then `/opt/belayer/trl-venv/bin/python -m belayer.examples.trl_grpo`")


@dataclass
class RunConfig:
    steps: int = 4
    prompts_per_step: int = 2
    group_size: int = 4
    lr: float = 1e-4
    sft_steps: int = 40
    sft_lr: float = 5e-3
    container_kills_per_step: int = 1
    worker_kills_per_step: int = 1
    beyond_recovery_per_step: int = 0
    parallel: int = 4
    threads: int = 1
    seed: int = 0
    tasks: int = len(TASKS)
    """The first this many tasks make the dataset (and the warm start's expert sequences)."""
    mode: str = "rollout_func"
    """``rollout_func`` (the rollouts are Belayer episodes) or ``environment_factory`` (TRL's own
    tool-calling loop over a ``SandboxEnvironment``, the engine generating: ``trainer.py``)."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)


class Rollouts:
    """TRL's ``rollout_func(prompts, trainer) -> dict``: one Belayer episode per prompt."""

    def __init__(self, cfg: RunConfig, engine, codec, log=print):
        self.cfg, self.engine, self.codec, self.log = cfg, engine, codec, log
        self.version = 0  # the engine's weight version the next rollouts must come from
        self.samples: list[tuple[int, int, Sample]] = []  # (step, expected version, sample) handed to TRL
        self.dropped_with_group = 0  # samples trained on with no weight because a sample of their group was dropped

    def plan(self, i: int) -> Plan:
        c, w, b = self.cfg.container_kills_per_step, self.cfg.worker_kills_per_step, self.cfg.beyond_recovery_per_step
        return Plan(kill_container_at=min(2, self.cfg.episode.turns) if i < c else None,
                    kill_worker_at=1 if c <= i < c + w else None,
                    beyond_recovery_at=min(2, self.cfg.episode.turns) if c + w <= i < c + w + b else None)

    def __call__(self, prompts: list, trainer) -> dict:
        step = trainer.state.global_step + 1
        texts = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
        t0 = time.monotonic()

        def one(i: int) -> Sample:  # the infrastructure policy retries it in fresh sandboxes, else drops it
            return run_episode(BY_PROMPT[texts[i]], self.engine, self.codec, self.cfg.episode, self.plan(i))

        with ThreadPoolExecutor(self.cfg.parallel) as pool:
            samples = list(pool.map(one, range(len(texts))))
        self.samples += [(step, self.version, s) for s in samples]
        im_end = self.codec.encode("<|im_end|>")[0]
        # TRL's prompts come in groups of num_generations: a dropped sample takes its group with it
        drop = drop_mask([i // self.cfg.group_size for i in range(len(samples))], [bool(s.failed) for s in samples],
                         self.cfg.episode.infra)
        self.dropped_with_group += sum(1 for s, d in zip(samples, drop, strict=True) if d and not s.failed)
        ok = [s for s, d in zip(samples, drop, strict=True) if not d]
        self.log(f"step {step}: {len(samples)} episodes in {time.monotonic() - t0:.1f}s, weight version "
                 f"{self.version}, reward {statistics.fmean(s.reward for s in ok) if ok else float('nan'):.3f}, "
                 f"container kills {sum(s.container_kills for s in samples)} (env recoveries "
                 f"{sum(s.env_recoveries for s in samples)}), worker kills {sum(s.worker_kills for s in samples)} "
                 f"(generations continued {sum(s.worker_recoveries for s in samples)})")
        return {  # a dropped sample: no tokens of its own, no reward (None: TRL's unscorable, advantage 0), no
            # loss on its group's tokens (env_mask 0); never a reward of 0
            "prompt_ids": [s.prompt_ids for s in samples],
            "completion_ids": [s.completion_ids if not s.failed else [im_end] for s in samples],
            "logprobs": [s.logprobs if not s.failed else [0.0] for s in samples],
            "env_mask": [[0] * max(len(s.env_mask), 1) if d else s.env_mask for s, d in zip(samples, drop, strict=True)],
            "env_reward": [None if d else s.reward for s, d in zip(samples, drop, strict=True)],
        }


def env_reward(completions, env_reward, **kwargs) -> list[float | None]:
    """TRL reward function: the reward each episode's sandbox gave (``rollout_func``'s extra field)."""
    return list(env_reward)


def push_weights_callback(weights, names: set[str], rollouts: Rollouts, log):
    """A ``TrainerCallback`` that pushes the model to the engine after each optimizer step."""
    from transformers import TrainerCallback

    class PushWeights(TrainerCallback):
        def __init__(self):
            self.pushes: list[dict] = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            t0 = time.monotonic()
            sd = {n: t.detach() for n, t in model.state_dict().items() if n in names}
            rollouts.version = weights.update_weights(sd)
            self.pushes.append({"step": state.global_step, "version": rollouts.version,
                                "seconds": round(time.monotonic() - t0, 3)})
            log(f"  weights of step {state.global_step} pushed: engine serves version {rollouts.version}")

    return PushWeights()


def run(cfg: RunConfig, log=print) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16: we know
    try:
        import torch
        import transformers
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise SystemExit(f"TRL is not importable here ({exc}; python {sys.executable}): {SETUP_HINT}") from exc
    from belayer_engine.backends.sglang.model_dir import ensure_embedded_model
    from belayer_engine.engine import RecoverableEngine
    from belayer_engine.model.config import ModelConfig
    from belayer_engine.model.weights import weight_specs
    from belayer_engine.router.codec import load_codec
    from belayer_engine.weights.client import EngineWeights

    t_start = time.monotonic()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    model_dir = ensure_embedded_model()
    codec = load_codec(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pad_id = model.config.pad_token_id
    log(f"model {model_dir.name}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} "
        f"parameters (trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__})")
    names = set(weight_specs(ModelConfig.from_dir(model_dir)))
    with RecoverableEngine.launch(model=str(model_dir)) as engine:
        engine.wait_ready(stable=True)
        log(f"engine ready at {engine.base_url} ({time.monotonic() - t_start:.1f}s)")
        weights = EngineWeights(engine.weights_socket)
        env_mode = cfg.mode == "environment_factory"
        rollouts = Rollouts(cfg, engine, codec, log)
        if env_mode:  # TRL's tool-calling loop over SandboxEnvironment; the engine generates (trainer.py)
            from .trainer import EnvRollouts, environment_trainer, tool_setup

            rollouts = EnvRollouts(cfg, rollouts.plan, log)
        pusher = push_weights_callback(weights, names, rollouts, log)
        batch = cfg.prompts_per_step * cfg.group_size
        with tempfile.TemporaryDirectory(prefix="belayer-trl-") as out:
            args = GRPOConfig(
                output_dir=out, per_device_train_batch_size=batch, num_generations=cfg.group_size,
                gradient_accumulation_steps=1, max_steps=cfg.steps, learning_rate=cfg.lr,
                temperature=cfg.episode.temperature, beta=0.0, logging_steps=1, report_to="none",
                save_strategy="no", use_cpu=True, seed=cfg.seed, dataloader_num_workers=0,
                disable_tqdm=True, lr_scheduler_type="constant",
                **({"max_completion_length": (cfg.episode.turns + 1) * (cfg.episode.max_new_tokens + 128),
                    "max_tool_calling_iterations": cfg.episode.turns} if env_mode else {}))
            # TRL's tool loop parses tool calls only from conversational prompts
            dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t.prompt}] if env_mode else t.prompt}
                                         for t in TASKS[: cfg.tasks]])
            tokenizer = _tokenizer(model_dir)
            if env_mode:
                tools, template = tool_setup(tokenizer, cfg.episode, rollouts.plans)
                seqs = [expert_ids(tokenizer, t, tools, template) for t in TASKS[: cfg.tasks]]
            else:
                seqs = [expert_sequence(t, codec) for t in TASKS[: cfg.tasks]]
            sft = warm_start(model, seqs, cfg.sft_steps, cfg.sft_lr, pad_id) if cfg.sft_steps else []
            rollouts.version = weights.update_weights(
                {n: t.detach() for n, t in model.state_dict().items() if n in names})
            log(f"warm start: {len(sft)} steps, loss {sft[0] if sft else '-'} -> {sft[-1] if sft else '-'}; "
                f"engine serves version {rollouts.version}")
            if env_mode:
                trainer = environment_trainer(model, args, tokenizer, dataset, engine, cfg, rollouts, pusher)
            else:
                trainer = GRPOTrainer(
                    model=model, args=args, processing_class=tokenizer, reward_funcs=[env_reward],
                    train_dataset=dataset, rollout_func=rollouts, callbacks=[pusher])
            try:
                trainer.train()
            finally:
                for pool in (getattr(trainer, "_environment_pool", None) or {}).values():
                    for env in pool:
                        env._close()
            history = list(trainer.state.log_history)
        final_version = weights.version()
        engine_events = engine.events()
    return summarize(cfg, rollouts, pusher.pushes, history, engine_events, sft, final_version,
                     time.monotonic() - t_start)


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def summarize(cfg: RunConfig, rollouts: Rollouts, pushes: list[dict], history: list[dict],
              engine_events: list[dict], sft: list[float], final_version: int, seconds: float) -> dict:
    everything = [s for _, _, s in rollouts.samples]
    trained = [s for _, _, s in rollouts.samples if not s.failed]
    lost = [s for _, _, s in rollouts.samples if s.failed]  # TRL got no sample (reward None) for these
    mixed = [s for _, v, s in rollouts.samples if not s.failed and set(s.versions) != {v}]
    kills_c = sum(s.container_kills for s in everything)
    kills_w = sum(s.worker_kills for s in everything)
    rec_c = sum(min(s.container_kills, s.env_recoveries) for s in trained)
    beyond = sum(s.beyond_recovery for s in everything)  # counted in kills_c too
    rec_beyond = sum(min(s.beyond_recovery, s.fresh_sandbox_retries) for s in trained)
    handovers = sum(1 for e in engine_events if e.get("event") == "handover")
    # a worker kill is recovered when the engine handed its slot over (the shadow took its
    # in-flight generations) and no episode lost a sample: the engine served on throughout
    rec_w = min(kills_w, handovers) if not lost else 0
    trl_log = [{"step": h["step"], "loss": h.get("loss"), "reward": h.get("reward"), "reward_std": h.get("reward_std")}
               for h in history if "loss" in h and "reward" in h]
    by_step: dict[int, list[float]] = {}
    for step, _, s in rollouts.samples:
        if not s.failed:
            by_step.setdefault(step, []).append(s.reward)
    return {
        "steps": len(trl_log), "samples": len(trained), "samples_lost": len(lost),
        "samples_dropped_with_group": rollouts.dropped_with_group,
        "fresh_sandbox_retries": sum(s.fresh_sandbox_retries for s in everything),
        "samples_mixed_versions": len(mixed),
        "faults_injected": {"container_kill": kills_c, "worker_sigkill": kills_w, "beyond_recovery": beyond},
        "faults_recovered": {"container_kill": rec_c, "worker_sigkill": rec_w, "beyond_recovery": rec_beyond},
        "all_faults_recovered": rec_c == kills_c and rec_w == kills_w and rec_beyond == beyond,
        "env_recoveries": sum(s.env_recoveries for s in trained),
        "env_restored_boundaries": _counts(j for s in trained for j in s.restored),
        "turns_rolled_back": sum(s.rolled_back_turns for s in trained),
        "generations_continued": sum(s.worker_recoveries for s in trained),
        "killed_generations_continued": sum(s.killed_generation_recovered for s in trained),
        **({"tool_calls": sum(s.tool_calls for s in everything), "trl_received": rollouts.received}
           if cfg.mode == "environment_factory" else {}),
        "engine_handovers": handovers,
        "weight_pushes": pushes, "engine_weight_version": final_version,
        "sample_versions_by_step": {str(k): sorted({v for st, v, _ in rollouts.samples if st == k}) for k in by_step},
        "reward_by_step": {str(k): round(statistics.fmean(v), 4) for k, v in sorted(by_step.items())},
        "trl_log": trl_log, "sft_loss": [sft[0], sft[-1]] if sft else None,
        "config": json.loads(json.dumps(asdict(cfg), default=lambda o: o.model_dump())), "seconds": round(seconds, 1),
    }


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items()))


def main(cfg: RunConfig, as_json: bool) -> int:
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if as_json else (lambda msg: print(msg, flush=True))
    # --json: stdout carries the summary alone (TRL prints its log lines there: to stderr with ours)
    with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():
        summary = run(cfg, log)
    if as_json:
        print(json.dumps(summary))
    else:
        print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=1))
    ok = summary["samples_lost"] == 0 and summary["samples_mixed_versions"] == 0 and summary["all_faults_recovered"]
    return 0 if ok else 1
