"""One multi-turn episode as one TRL sample: model turns from the engine, commands in the env.

The engine is reached through SGLang's native ``POST /generate`` (token ids in; token
ids, logprobs and ``weight_versions`` out, streamed), as the trainers that speak SGLang
reach it. A sample is TRL's multi-turn shape: ``prompt_ids`` (the task, rendered by the
router's own codec), then ``completion_ids`` = model turn 1, observation 1, model turn
2, ...; ``env_mask`` is 1 on model tokens (trained) and 0 on observation tokens (not),
``logprobs`` are the engine's on model tokens (0.0 on observation tokens).

Faults fire here, for real: ``kill_container_at`` SIGKILLs the episode's container while
the model generates turn n, once boundary n-1's checkpoint is written (the env restores
it in the background, CRIU included, and runs turn n's command on the restored sandbox;
when it has to restore an older boundary j instead, the tokens of the turns after j are
cut and those turns regenerated, never replayed); ``kill_worker_at`` SIGKILLs the
engine's serving worker once the first token of turn n's generation has arrived (the
router continues the generation on the shadow; this episode sees one generation).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import requests

from belayer.wrappers.chat_history import parse_bash_block
from belayer.wrappers.infra_policy import InfraPolicy, PolicyEnv
from belayer_core.errors import BelayerError, InfraError
from belayer_env.common.phases import Phase
from belayer_env.env.config import SUBMIT_MARKER, EnvConfig
from belayer_env.env.recoverable import RecoverableSandboxEnv
from belayer_env.faults.inject import FaultInjector, InjectedFault
from belayer_env.sandbox.config import SandboxConfig

from .tasks import WORKDIR, FileReward, Task

OBS_CHARS = 48  # an observation's output is cut to this many characters (short sequences)


@dataclass
class EpisodeConfig:
    turns: int = 2
    max_new_tokens: int = 24
    temperature: float = 1.0
    command_timeout_s: float = 5.0
    checkpoint_policy: str = "always"
    infra: InfraPolicy = field(default_factory=InfraPolicy)
    """Exhausted env recovery: a fresh sandbox (a rollback to 0), then the sample is dropped with its group."""


@dataclass
class Turn:
    model_ids: list[int]
    logprobs: list[float]
    env_ids: list[int] = field(default_factory=list)  # the observation that followed


@dataclass
class Sample:
    """One episode: TRL's fields plus what happened to it."""

    task: str
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    versions: list[int] = field(default_factory=list)  # every weight version any of its tokens came from
    container_kills: int = 0
    env_recoveries: int = 0  # rollbacks + restores while the model generated
    restored: list[int] = field(default_factory=list)  # the boundary each env recovery restored
    rolled_back_turns: int = 0  # turns cut by a rollback and regenerated
    worker_kills: int = 0
    worker_recoveries: int = 0  # generations continued on the shadow (any worker death, ours or not)
    killed_generation_recovered: int = 0  # of our worker kills: the generation it hit was continued
    failed: str | None = None  # the infrastructure policy dropped it: no reward, its group goes too
    fresh_sandbox_retries: int = 0
    beyond_recovery: int = 0  # planned kills whose restores were made to fail
    tool_calls: int = 0  # environment_factory: the ``bash`` calls TRL's tool loop ran in the sandbox
    seconds: float = 0.0


class Plan:
    """Which turn of this episode gets which fault (``turn`` is 1-based). ``beyond_recovery_at``:
    the container is SIGKILLed while the model writes that turn and every restore of this
    sandbox fails as it is created (the infrastructure policy's fresh sandbox is spared)."""

    def __init__(self, kill_container_at: int | None = None, kill_worker_at: int | None = None,
                 beyond_recovery_at: int | None = None):
        self.kill_container_at, self.kill_worker_at = kill_container_at, kill_worker_at
        self.beyond_recovery_at = beyond_recovery_at


def doom_sandbox(env: RecoverableSandboxEnv) -> None:
    """Every restore of the env's current sandbox fails at its "created" phase (a phase hook
    raising, as the project's fault injector does); a fresh sandbox (a new name) is spared."""
    doomed = env.name

    def hook(phase: Phase) -> None:
        if phase == Phase.CREATED and env.name == doomed:
            raise InjectedFault(f"injected: sandbox {doomed} cannot be restored")

    env.add_phase_hook(hook)


def generate(root: str, input_ids: list[int], cfg: EpisodeConfig, on_chunk=None) -> dict:
    """One streamed native ``/generate``; returns the final chunk (output ids, meta_info).
    ``on_chunk(chunk)`` sees each chunk until it returns True."""
    body = {"input_ids": input_ids, "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature}}
    last = None
    with requests.post(root + "/generate", json=body, stream=True, timeout=300) as resp:
        if resp.status_code != 200:
            raise BelayerError(f"/generate answered {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            last = json.loads(data)
            if on_chunk is not None and on_chunk(last):
                on_chunk = None
    if last is None or not (last.get("meta_info") or {}).get("finish_reason"):
        raise BelayerError("/generate stream ended without a finished generation")
    return last


_KILL_LOCK = threading.Lock()  # one worker kill at a time, each onto a stable engine


def kill_serving_worker(engine) -> int | None:
    """SIGKILL the serving worker of slot w0 (its pid from the supervisor) if the engine is
    stable right now; returns the pid (None: no kill)."""
    with _KILL_LOCK:
        if not _stable(engine, timeout=0.5):
            return None
        slot = engine.status()["slots"]["w0"]
        pid = slot.get("worker_pid")
        if not (slot.get("routed") and pid):
            return None
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            return None
        return int(pid)


def _stable(engine, timeout: float = 180.0) -> bool:
    """The engine serves with a shadow armed, its last handover outside the supervisor's
    unhealthy window (a kill sooner would rightly exclude the device)."""
    try:
        engine.wait_ready(timeout=timeout, stable=True)
    except BelayerError:
        return False
    return True


def make_env(task: Task, cfg: EpisodeConfig) -> RecoverableSandboxEnv:
    sandbox = SandboxConfig(cwd=WORKDIR, timeout=cfg.command_timeout_s, memory="128m", disk=None)
    # turns model commands + the harness's submit; restores start while the model generates
    config = EnvConfig(sandbox=sandbox, max_steps=cfg.turns + 1, recover_while_idle=True)
    return RecoverableSandboxEnv(config, checkpoint_policy=cfg.checkpoint_policy, reward=FileReward(task))


def command_of(codec, ids: list[int]) -> str:
    text = codec.decode_output(ids, skip_special_tokens=True)
    return parse_bash_block(text).replace("\x00", "").strip() or "true"


def observation_ids(codec, model_ids: list[int], observation: str, im_end: int) -> list[int]:
    """The tokens between two model turns: the turn's end, the observation as a user message,
    the next assistant header (the router's own chat rendering, content as plain text)."""
    close = codec.encode("\n") if model_ids and model_ids[-1] == im_end else codec.encode("<|im_end|>\n")
    short = observation if len(observation) <= OBS_CHARS else observation[:OBS_CHARS] + "..."
    return close + codec.render_chat([{"role": "user", "content": short}])


def run_episode(task: Task, engine, codec, cfg: EpisodeConfig, plan: Plan) -> Sample:
    """Roll ``task`` out against ``engine`` in a fresh ``RecoverableSandboxEnv``."""
    started = time.monotonic()
    sample = Sample(task=task.prompt)
    root = engine.base_url.removesuffix("/v1")
    im_end = codec.encode("<|im_end|>")[0]
    env = make_env(task, cfg)
    policy = PolicyEnv(env, cfg.infra)
    injector = FaultInjector(env)
    try:
        policy.reset(options=task.reset_options())
        sample.prompt_ids = codec.render_chat([{"role": "user", "content": task.prompt}])
        turns: list[Turn] = []
        fired: set[str] = set()
        for _ in range(cfg.turns * 4 + 4):  # bounded even with repeated rollbacks
            if len(turns) == cfg.turns:  # every model turn done: the harness submits, the env scores
                _, reward, terminated, _, info = policy.step(f"echo {SUBMIT_MARKER}")
                if _cut_on_rollback(info, turns, sample):
                    continue
                sample.reward = float(reward) if terminated else 0.0
                break
            n = len(turns) + 1
            if plan.kill_container_at == n and "container" not in fired:
                fired.add("container")
                env.settle(timeout=120)  # the newest boundary's checkpoint written (or given up)
                injector.fire("kill")  # the container dies while the model writes turn n
                sample.container_kills += 1
            if plan.beyond_recovery_at == n and "beyond" not in fired:
                fired.add("beyond")
                env.settle(timeout=120)
                doom_sandbox(env)
                injector.fire("kill")  # dies while the model writes turn n; its restores fail: a fresh sandbox
                sample.container_kills += 1
                sample.beyond_recovery += 1
            kill, killed = None, []
            if plan.kill_worker_at is not None and n >= plan.kill_worker_at and "worker" not in fired \
                    and _stable(engine):  # a kill only onto a shadow armed and ready, else none

                def kill(chunk: dict, killed: list = killed) -> bool:
                    if (chunk.get("meta_info") or {}).get("finish_reason"):
                        return True  # finished in one chunk: no kill now, try the next turn
                    if kill_serving_worker(engine) is not None:
                        killed.append(True)
                        return True
                    return False  # not stable this instant (another kill's handover): the next chunk
            context = sample.prompt_ids + [i for t in turns for i in t.model_ids + t.env_ids]
            out = generate(root, context, cfg, on_chunk=kill)
            meta = out["meta_info"]
            belayer = meta.get("belayer") or {}
            sample.versions += [int(s["version"]) for s in meta.get("weight_versions") or []]
            recovered = int(belayer.get("recoveries") or 0)
            sample.worker_recoveries += recovered
            if killed:
                fired.add("worker")
                sample.worker_kills += 1
                sample.killed_generation_recovered += int(recovered > 0)
            ids = list(out["output_ids"])
            lps = [float(x[0]) for x in meta["output_token_logprobs"]]
            if len(lps) != len(ids):
                raise BelayerError(f"{len(ids)} output ids but {len(lps)} logprobs")
            turn = Turn(ids, lps)
            observation, _, _, _, info = policy.step(command_of(codec, ids))
            if _cut_on_rollback(info, turns, sample):
                continue  # this turn's tokens are dropped too: its action never committed
            turn.env_ids = observation_ids(codec, ids, observation, im_end)
            turns.append(turn)
        else:
            raise BelayerError("episode did not finish within its bound of turns")
        for k, t in enumerate(turns):
            last = k == len(turns) - 1
            env_ids = [] if last else t.env_ids
            sample.completion_ids += t.model_ids + env_ids
            sample.logprobs += t.logprobs + [0.0] * len(env_ids)
            sample.env_mask += [1] * len(t.model_ids) + [0] * len(env_ids)
    except (InfraError, BelayerError, requests.RequestException) as exc:
        sample.failed = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        sample.fresh_sandbox_retries = len(policy.attempts)
        injector.close()
        env.close()
    sample.seconds = round(time.monotonic() - started, 2)
    return sample


def _cut_on_rollback(info: dict, turns: list[Turn], sample: Sample) -> bool:
    """Count an env recovery; on a rollback to boundary j drop the turns after j. True when
    the step's action did not commit (the caller regenerates from boundary j)."""
    belayer = info.get("belayer", {})
    rollback, idle = belayer.get("rollback"), belayer.get("recovered_while_idle")
    if rollback is None and idle is None:
        return False
    sample.env_recoveries += 1
    sample.restored.append(int((rollback or idle)["to_step"]))
    if rollback is None:  # restored onto this very boundary while the model generated: it committed
        return False
    j = int(rollback["to_step"])
    sample.rolled_back_turns += max(len(turns) - j, 0)
    del turns[j:]
    return True
