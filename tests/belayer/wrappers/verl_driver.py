"""Runs verl 0.9.1's own agent-loop path in verl's venv, for tests/belayer/wrappers/test_verl.py.

``python verl_driver.py ENGINE_URL MODEL_DIR``; then one JSON phase per stdin line
(``{"phase", "rows", "episode", "kill_container"}``), one JSON result per stdout line. Each
phase builds verl's config from its own ``ppo_trainer.yaml`` (hydra), registers the loop
through verl's ``agent_loop_config_path`` file (with the phase's ``belayer`` episode config),
makes a verl ``AgentLoopWorker`` with Belayer's ``EngineClient`` and runs
``generate_sequences`` on a ``DataProto`` batch, as verl's ``AgentLoopManager`` does in each
worker actor. It observes (never changes) what the engine answered each sample, and fires
one real fault on request: a SIGKILL of a sample's container through Docker when that
sample's n-th generation starts.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import sys
import tempfile
import traceback
from pathlib import Path

import numpy as np
import verl
import yaml
from hydra import compose, initialize_config_dir
from verl.experimental.agent_loop import AgentLoopWorker
from verl.protocol import DataProto

import belayer.wrappers.verl.agent_loop as loop_module
from belayer.wrappers.verl.client import EngineClient
from belayer_env.faults.inject import kill_container
from belayer_env.sandbox.docker_api import connect

PROMPTS = ["List the files in /tmp, then submit.", "Print the date, then submit."]
SAMPLE = contextvars.ContextVar("sample", default=None)


def verl_config(model_dir: str, loops_yaml: str):
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer" / "config"), version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.prompt_length=256", "actor_rollout_ref.rollout.response_length=512",
            "actor_rollout_ref.rollout.calculate_log_probs=true",
            "actor_rollout_ref.rollout.top_k=1",  # greedy: a run with faults must equal the fault-free one
            "actor_rollout_ref.rollout.agent.default_agent_loop=belayer_sandbox",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}",
            "data.max_prompt_length=256", "data.max_response_length=512"])


class Observer:
    """Records each sample's generations; kills a sample's container when asked."""

    current: Observer | None = None

    def __init__(self, kill: dict | None):
        self.calls: dict[int, list[dict]] = {}
        self.envs: dict[int, object] = {}
        self.kill, self.killed = kill, []

    async def before_generate(self) -> None:
        sample = SAMPLE.get()
        calls = self.calls.setdefault(sample, [])
        if self.kill and sample == self.kill["sample"] and len(calls) + 1 == self.kill["at_call"]:
            env = self.envs[sample].unwrapped
            await asyncio.to_thread(env.settle)  # bounded: the last boundary's capture, as during a generation
            kill_container(connect(), env.sandbox.container_id)
            self.killed.append(sample)

    def after_generate(self, out) -> None:
        self.calls[SAMPLE.get()].append({"ids": out.token_ids, "logprobs": out.log_probs,
                                         "version": out.extra_fields["global_steps"]})


def observe() -> None:
    """Wrap (once) the client's generate, the loop's env factory and ``run`` with ``Observer.current``."""
    generate, make_env, run = EngineClient.generate, loop_module.episode_env, loop_module.BelayerSandboxAgentLoop.run

    async def observed_generate(self, *args, **kwargs):
        await Observer.current.before_generate()
        out = await generate(self, *args, **kwargs)
        Observer.current.after_generate(out)
        return out

    def observed_env(config, meta):
        env = make_env(config, meta)
        Observer.current.envs[SAMPLE.get()] = env
        return env

    async def observed_run(self, sampling_params, **kwargs):
        SAMPLE.set(int(kwargs["sample_id"]))
        return await run(self, sampling_params, **kwargs)

    EngineClient.generate = observed_generate
    loop_module.episode_env = observed_env
    loop_module.BelayerSandboxAgentLoop.run = observed_run


def batch(rows: int) -> DataProto:
    prompts = [PROMPTS[i // 2 % len(PROMPTS)] for i in range(rows)]  # groups of 2 (verl's rollout.n = 2)
    return DataProto.from_dict(non_tensors={
        "raw_prompt": np.array([[{"role": "user", "content": p}] for p in prompts], dtype=object),
        "extra_info": np.array([{"setup": "mkdir -p /tmp/work", "max_turns": 3} for _ in prompts], dtype=object),
        "index": np.array([i // 2 for i in range(rows)]),
        "sample_id": np.array(list(range(rows))),
    })


def rows_of(out: DataProto) -> list[dict]:
    prompt_len = out.batch["prompts"].shape[1]
    rows = []
    for i in range(len(out)):
        n = int(out.batch["attention_mask"][i, prompt_len:].sum())
        rows.append({"response_ids": out.batch["responses"][i, :n].tolist(),
                     "mask": out.batch["response_mask"][i, :n].tolist(),
                     "logprobs": out.batch["rollout_log_probs"][i, :n].tolist(),
                     "reward": float(out.batch["rm_scores"][i].sum()),
                     "belayer": out.non_tensor_batch["belayer"][i],
                     "min_global_steps": out.non_tensor_batch["min_global_steps"][i],
                     "max_global_steps": out.non_tensor_batch["max_global_steps"][i]})
    return rows


def run_phase(url: str, model_dir: str, spec: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump([{"name": "belayer_sandbox", "_target_": "belayer.wrappers.verl.agent_loop.BelayerSandboxAgentLoop",
                         "belayer": spec["episode"]}], f)
    config = verl_config(model_dir, f.name)
    observer = Observer.current = Observer(spec.get("kill_container"))
    worker = AgentLoopWorker(config, EngineClient(config, base_url=url))
    result = {"phase": spec["phase"], "rows": None, "error": None}
    try:
        result["rows"] = rows_of(asyncio.run(worker.generate_sequences(batch(spec["rows"]))))
    except Exception as e:  # noqa: BLE001 - what verl's worker raised is the result
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-3000:]
    result["calls"] = {str(k): v for k, v in observer.calls.items()}
    result["killed_containers"] = observer.killed
    return result


def main() -> None:
    url, model_dir = sys.argv[1], sys.argv[2]
    observe()
    print(json.dumps({"phase": "ready"}), flush=True)
    for line in sys.stdin:
        print(json.dumps(run_phase(url, model_dir, json.loads(line)), default=str), flush=True)


if __name__ == "__main__":
    main()
