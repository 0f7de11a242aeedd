"""``GRPOTrainer(environment_factory=...)`` with Belayer's engine generating (TRL 1.16).

TRL runs its own tool-calling loop over ``SandboxEnvironment`` (``environment.py``); what
changes is only where tokens come from: ``EngineGRPOTrainer._generate_single_turn`` asks the
engine (SGLang's native ``/generate``, streamed; a worker SIGKILLed mid-generation is
continued on the shadow) instead of TRL's in-process or vLLM generation, and records the
weight versions the engine reports.

``EngineGRPOTrainer._generate`` puts the infrastructure policy around TRL's loop: after
TRL's generation it scores every rollout in its sandbox (the harness submits), so that a
sandbox lost at any point surfaces before TRL computes advantages; each rollout marked
``retry`` is rolled out again from its prompt in a fresh sandbox, by TRL's own generation
for those rollouts only; a dropped rollout takes its group along: reward ``None`` (TRL's
unscorable, advantage 0) and no loss on the group's tokens (tool mask 0).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from belayer.wrappers.infra_policy import drop_mask

from .environment import PlanQueue, SandboxEnvironment, sandbox_reward
from .episode import Sample, generate, kill_serving_worker


def engine_trainer_class():
    """``GRPOTrainer`` with the engine as its generator and the policy's retry around TRL's loop."""
    from trl import GRPOTrainer

    class EngineGRPOTrainer(GRPOTrainer):
        def __init__(self, *args: Any, belayer_engine, belayer_cfg, belayer_rollouts, **kwargs: Any):
            self._belayer = (belayer_engine, belayer_cfg, belayer_rollouts)
            super().__init__(*args, **kwargs)

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            # prompt_ids holds one row per rollout (TRL repeats each prompt num_generations times)
            engine, cfg, rollouts = self._belayer
            root = engine.base_url.removesuffix("/v1")
            kill_now, killed = rollouts.take_worker_kill(), []

            def kill(chunk: dict) -> bool:  # the serving worker dies once a first, unfinished chunk arrived
                if (chunk.get("meta_info") or {}).get("finish_reason"):
                    return True  # finished in one chunk: no kill now, the next generation call tries
                if kill_serving_worker(engine) is not None:
                    killed.append(True)
                    return True
                return False  # not stable this instant: the next chunk

            def one(k: int) -> dict:
                out = generate(root, list(prompt_ids[k]), cfg.episode, on_chunk=kill if kill_now and k == 0 else None)
                out["killed"] = bool(killed) and k == 0
                return out

            with ThreadPoolExecutor(max(1, min(cfg.parallel, len(prompt_ids)))) as pool:
                outs = list(pool.map(one, range(len(prompt_ids))))
            rollouts.record(outs, kill_pending=kill_now and not killed)
            return ([list(o["output_ids"]) for o in outs],
                    [[float(x[0]) for x in o["meta_info"]["output_token_logprobs"]] for o in outs])

        def _generate(self, prompts):
            engine, cfg, rollouts = self._belayer
            rollouts.start_step()
            out = list(super()._generate(prompts))
            envs = self.environments
            while True:
                for e in envs:
                    e._score()
                redo = [i for i, e in enumerate(envs) if e.state == "retry"]
                if not redo:
                    break
                for i in redo:
                    envs[i]._restart()
                if redo := [i for i in redo if envs[i].state == "ok"]:
                    self._redo(prompts, redo, out)
            drop = drop_mask([i // cfg.group_size for i in range(len(prompts))],
                             [e.state == "dropped" for e in envs], cfg.episode.infra)
            for e, d in zip(envs, drop, strict=True):
                e.trained = not d
            out[2] = [[0] * len(m) if d else m for m, d in zip(out[2], drop, strict=True)]  # tool mask: no loss
            rollouts.finish_step(self.state.global_step + 1, envs, drop, out[2])
            return tuple(out)

        def _redo(self, prompts, redo: list[int], out: list) -> None:
            """TRL's own generation for the rollouts in ``redo`` only (each in its fresh sandbox)."""
            keep = (self.environments, self._sync_tool_dicts, self._async_tool_dicts, self._batch_environments)

            def pick(seq: list) -> list:
                return [seq[i] for i in redo]

            self.environments, self._sync_tool_dicts, self._async_tool_dicts, self._batch_environments = map(pick, keep)
            try:
                sub = super()._generate([prompts[i] for i in redo])
            finally:
                self.environments, self._sync_tool_dicts, self._async_tool_dicts, self._batch_environments = keep
            for field in (0, 1, 2, 3, 4):  # prompt ids, completion ids, tool mask, completions, logprobs
                for k, i in enumerate(redo):
                    out[field][i] = sub[field][k]

    return EngineGRPOTrainer


class EnvRollouts:
    """What ``run.summarize`` reads (as of ``run.Rollouts``), for the ``environment_factory`` run."""

    def __init__(self, cfg, plan, log=print):
        self.cfg, self.log = cfg, log
        self.version = 0  # the engine's weight version the next rollouts must come from
        self.samples: list[tuple[int, int, Sample]] = []
        self.dropped_with_group = 0
        self.received: list[dict] = []  # per step, what TRL trains on: rewards (None: unscorable), loss tokens
        self.plans = PlanQueue(plan, cfg.prompts_per_step * cfg.group_size)
        self._calls: list[dict] = []
        self._kill_pending = False

    def take_worker_kill(self) -> bool:
        """Whether this generation call kills the serving worker (until one kill per step happened)."""
        pending, self._kill_pending = self._kill_pending, False
        return pending

    def start_step(self) -> None:
        self._calls = []
        self._kill_pending = self.cfg.worker_kills_per_step > 0

    def record(self, outs: list[dict], kill_pending: bool) -> None:
        self._calls += outs
        self._kill_pending = self._kill_pending or kill_pending

    def finish_step(self, step: int, environments: list[SandboxEnvironment], drop: list[bool],
                    tool_mask: list[list[int]]) -> None:
        # every generation of the step, retries included: one version means no sample mixes versions
        versions = sorted({int(s["version"]) for o in self._calls for s in o["meta_info"].get("weight_versions") or []})
        recovered = sum(int((o["meta_info"].get("belayer") or {}).get("recoveries") or 0) for o in self._calls)
        killed = sum(o["killed"] for o in self._calls)
        hit = sum(int((o["meta_info"].get("belayer") or {}).get("recoveries") or 0) > 0 for o in self._calls if o["killed"])
        for k, e in enumerate(environments):
            s = e.sample
            s.versions = versions
            if k == 0:  # the step's engine figures, counted once
                s.worker_kills, s.worker_recoveries, s.killed_generation_recovered = killed, recovered, hit
            self.dropped_with_group += int(drop[k] and not s.failed)
            self.samples.append((step, self.version, s))
        samples = [e.sample for e in environments]
        self.received.append({"step": step, "rewards": [s.reward if not d else None for s, d in zip(samples, drop, strict=True)],
                              "loss_tokens": [sum(m) for m in tool_mask]})
        self.log(f"step {step}: {len(samples)} rollouts, {sum(s.tool_calls for s in samples)} bash calls, weight "
                 f"versions {versions}, container kills {sum(s.container_kills for s in samples)} (env recoveries "
                 f"{sum(s.env_recoveries for s in samples)}, fresh sandboxes "
                 f"{sum(s.fresh_sandbox_retries for s in samples)}), worker kills {killed} (generations continued "
                 f"{recovered}), dropped {sum(drop)}")


def tool_setup(tokenizer, episode, plans: PlanQueue) -> tuple[list, str]:
    """TRL's own Qwen3 tool-calling template on the tokenizer (TRL knows how to parse its
    ``<tool_call>`` JSON); the tools and the template TRL renders multi-turn conversations with
    (its training variant when the template is not prefix-preserving, as TRL picks it)."""
    from trl.chat_template_utils import (
        get_training_chat_template,
        is_chat_template_prefix_preserving,
        qwen3_chat_template,
    )

    tokenizer.chat_template = qwen3_chat_template
    template = (tokenizer.chat_template if is_chat_template_prefix_preserving(tokenizer)
                else get_training_chat_template(tokenizer))
    return [SandboxEnvironment(episode, plans).bash], template


def environment_trainer(model, args, tokenizer, dataset, engine, cfg, rollouts: EnvRollouts, pusher):
    """``GRPOTrainer(environment_factory=...)`` with the engine generating."""
    factory = functools.partial(SandboxEnvironment, cfg.episode, rollouts.plans)
    return engine_trainer_class()(
        model=model, args=args, processing_class=tokenizer, train_dataset=dataset,
        reward_funcs=[sandbox_reward], environment_factory=factory,
        callbacks=[pusher], belayer_engine=engine, belayer_cfg=cfg, belayer_rollouts=rollouts)
