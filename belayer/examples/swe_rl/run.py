"""Orchestrator: engine + learner process + fault schedule + live display + summary.

The engine (arena, worker, shadow, router) runs under ``RecoverableEngine``; the learner
is a separate process (``trainer.learner_process``, given the same ``RunConfig``) so that a
learner fault is a real SIGKILL followed by a restart that resumes from its newest complete checkpoint. Worker
kills come from ``faults.WorkerKiller``; container faults are injected inside the learner's
envs. Everything the summary reports is read back from the learner's event log and the
supervisor's event list.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path

from belayer_core.errors import BelayerError

from .config import RunConfig
from .faults import WorkerKiller
from .summary import summarize
from .trainer import learner_process


class Run:
    def __init__(self, cfg: RunConfig, display: Callable[[str], None] = print):
        self.cfg, self.display = cfg, display
        self.out = Path(cfg.out_dir).resolve()
        self.events: list[dict] = []
        self.learner_kills: list[dict] = []
        self.learner_exits: list[int] = []
        self._offset = 0
        self.base_url = self.weights_socket = ""

    def _prepare(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for name in ("events.jsonl", "expert.json", "learner.log", "summary.json"):
            (self.out / name).unlink(missing_ok=True)
        shutil.rmtree(self.out / "learner_ckpt", ignore_errors=True)

    def _spawn(self) -> BaseProcess:
        """A fresh learner process (spawned: a new interpreter, as after a real crash).

        Its OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE`` unless set): threads
        spinning on cores shared with the sandboxes and the engine slowed a GRPO update of 32
        episodes on 2 busy cores (load ~4.5) to 44 s; passive: 25 s (one thread: 32 s).
        """
        proc = multiprocessing.get_context("spawn").Process(
            target=learner_process, args=(self.cfg, self.base_url, self.weights_socket), name="learner", daemon=True)
        with _environ(OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE")):
            proc.start()  # the spawned interpreter inherits this process's environment as it is now
        return proc

    def _new_events(self) -> list[dict]:
        path = self.out / "events.jsonl"
        if not path.is_file():
            return []
        with open(path) as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        new = [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.events += new
        return new

    def execute(self) -> dict:
        from belayer_engine.engine import RecoverableEngine

        cfg = self.cfg
        self._prepare()
        t0 = time.time()
        self.display(f"starting engine (arena + worker + shadow) ... out: {self.out}")
        with RecoverableEngine.launch() as engine:
            engine.wait_ready(stable=True)
            engine_start_s = time.time() - t0
            self.display(f"engine ready in {engine_start_s:.1f}s at {engine.base_url}")
            self.base_url, self.weights_socket = engine.base_url, engine.weights_socket
            killer = WorkerKiller(engine, cfg.faults, seed=cfg.seed)
            proc = self._spawn()
            try:
                proc = self._supervise(proc, killer)
            finally:
                killer.stop()
                if proc.is_alive():
                    proc.kill()
                proc.join()
            with contextlib.suppress(BelayerError):
                engine.wait_ready(timeout=60)  # a handover still under way gets into the events
            engine_events = engine.events()
        summary = summarize(self.events, engine_events, killer.kills, self.learner_kills,
                            seconds=time.time() - t0, engine_start_s=engine_start_s, parallel=cfg.parallel)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        with contextlib.suppress(Exception):
            from .plot import plot_run

            summary["plot"] = str(plot_run(self.events, engine_events, killer.kills, self.learner_kills,
                                           summary, self.out / "run.png", t0))
        return summary

    def _supervise(self, proc: BaseProcess, killer: WorkerKiller) -> BaseProcess:
        killed_at: set[int] = set()
        done = False
        while not done:
            proc.join(timeout=0.25)  # bounded poll of the learner's exit and its event log
            code = proc.exitcode
            for ev in self._new_events():
                self._show(ev, killer)
                if ev["event"] == "weights":
                    killer.start()
                if ev["event"] == "done":
                    done = True
                if (ev["event"] == "saving" and ev["step"] in self.cfg.faults.learner_kill_steps
                        and ev["step"] not in killed_at and proc.is_alive()):
                    proc.kill()  # SIGKILL
                    self.learner_kills.append({"wall": time.time(), "step": ev["step"]})
                    proc.join()
                    self._reap_orphans(proc.pid)
                    killed_at.add(ev["step"])
                    self.display(f"  !! learner SIGKILLed at the step-{ev['step']} boundary, just after its "
                                 "checkpoint save started: restarting")
                    proc = self._spawn()
                    code = None
            if code is not None and not done:
                self._new_events()
                if any(e["event"] == "done" for e in self.events):
                    break
                self.learner_exits.append(code)
                if len(self.learner_exits) > self.cfg.max_learner_restarts:
                    raise BelayerError(f"learner exited {code} too often; see {self.out / 'learner.log'}")
                self.display(f"  !! learner exited with {code}: restarting (see learner.log)")
                proc = self._spawn()
        return proc

    def _reap_orphans(self, pid: int) -> None:
        """Remove the containers of the killed learner's in-flight episodes (and only those)."""
        with contextlib.suppress(Exception):
            from belayer_env.ops.gc import list_managed, reap
            from belayer_env.sandbox.docker_api import connect

            client = connect()
            reap(client, [c for c in list_managed(client) if c.orphaned and c.owner.endswith(f":{pid}")])

    def _show(self, ev: dict, killer: WorkerKiller) -> None:
        kind = ev["event"]
        if kind == "expert":
            self.display(f"expert trajectories: {ev['episodes']} (played in real sandboxes)")
        elif kind == "sft" and ev.get("iter", 0) % 20 == 0:
            self.display(f"  warm start iter {ev['iter']:3d}  loss {ev['loss']:.3f}")
        elif kind == "sft_done":
            self.display(f"warm start done in {ev['seconds']}s (loss {ev['loss']})")
        elif kind == "resumed":
            self.display(f"  learner resumed from {ev['checkpoint']} (discarded interrupted: {ev['discarded']})")
        elif kind == "step":
            reward = "n/a" if ev["reward"] is None else f"{ev['reward']:.2f}"
            self.display(
                f"step {ev['step']:2d}/{self.cfg.steps}  reward {reward}  "
                f"env faults {ev['env_faults']} (recovered {ev['env_recoveries']})  "
                f"worker kills so far {len(killer.kills)}  labelled {ev['infra_labelled']}  "
                f"weights v{ev['version']}  {ev['seconds']:.1f}s")


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of the block (children started inside inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(cfg: RunConfig, display: Callable[[str], None] = print) -> dict:
    return Run(cfg, display).execute()
