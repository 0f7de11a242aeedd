"""SIGKILL the learner in the middle of an asynchronous save: resume uses the newest
complete checkpoint, never the interrupted one, with parameters and optimizer state equal
to what was saved at that step."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

from belayer.examples.swe_rl import learner_ckpt
from belayer.examples.swe_rl.config import LearnerConfig
from belayer.examples.swe_rl.learner import Learner

CHILD = r"""
import hashlib, sys, threading, torch
from belayer.examples.swe_rl.config import LearnerConfig
from belayer.examples.swe_rl.learner import Learner
from belayer.examples.swe_rl.learner_ckpt import LearnerCheckpointConfig, LearnerCheckpointer
from tests.belayer.examples.test_learner_ckpt import digest

directory, kill_at = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
learner = Learner(LearnerConfig(sft_batch=2))
ids = [list(range(1, 40)), list(range(5, 60))]
episodes_like = [(i, [(10, len(i))]) for i in ids]
blocked = threading.Event()
stdout_lock = threading.Lock()

def tell(*words):
    # The hook runs on the saver's thread: one locked write per line, or print's separate
    # writes of words and newline interleave with the main thread's lines.
    with stdout_lock:
        sys.stdout.write(" ".join(map(str, words)) + "\n")
        sys.stdout.flush()

def hook(phase, step):
    if phase == "published":
        tell("PUBLISHED", step)
    if phase == "payload_written" and step == kill_at:
        tell("SAVING", step)
        blocked.wait()          # the save stays interrupted until the parent kills us

ckpt = LearnerCheckpointer(LearnerCheckpointConfig(directory=directory, keep=10), phase_hook=hook)
from belayer.examples.swe_rl.policy import sequence_logprobs
for step in range(1, kill_at + 2):
    loss = -torch.cat(sequence_logprobs(learner.model, episodes_like)).mean()
    learner._update(loss, 1e-3)
    learner.step = step
    state = learner.snapshot(note=f"step {step}")
    tell("DIGEST", step, digest(state))
    ckpt.save_async(step, state)
ckpt.wait()
"""


def digest(state: dict) -> str:
    """SHA-256 over parameters and every optimizer state tensor (and the step)."""
    h = hashlib.sha256(str(state["extra"]["step"]).encode())
    for name, t in sorted(state["model"].items()):
        h.update(name.encode() + t.numpy().tobytes())
    for idx, entry in sorted(state["optimizer"]["state"].items()):
        for key, t in sorted(entry.items()):
            h.update(f"{idx}.{key}".encode() + (t.numpy().tobytes() if torch.is_tensor(t) else repr(t).encode()))
    return h.hexdigest()


def test_sigkill_during_save_resumes_from_newest_complete(tmp_path: Path):
    kill_at = 4
    root = Path(__file__).resolve().parents[3]
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(kill_at)], cwd=root,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    digests, published = {}, []
    try:
        for line in child.stdout:  # blocking reads: the child tells us where it is
            kind, step, *rest = line.split()
            if kind == "DIGEST":
                digests[int(step)] = rest[0]
            elif kind == "PUBLISHED":
                published.append(int(step))
            elif kind == "SAVING" and int(step) == kill_at:
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert published == list(range(1, kill_at))

    interrupted = [p for p in tmp_path.iterdir() if p.name.startswith(learner_ckpt.TMP_PREFIX)]
    assert len(interrupted) == 1 and f"{kill_at:08d}" in interrupted[0].name
    assert (interrupted[0] / learner_ckpt.PAYLOAD).is_file()  # the payload was there, unpublished

    newest = learner_ckpt.latest_complete(tmp_path)
    assert newest is not None and newest.name == f"step-{kill_at - 1:08d}"
    state = learner_ckpt.load(newest)
    assert digest(state) == digests[kill_at - 1]

    resumed = Learner(LearnerConfig())
    extra = resumed.restore(state)
    assert resumed.step == kill_at - 1 and extra["note"] == f"step {kill_at - 1}"
    assert digest(resumed.snapshot(note=extra["note"])) == digests[kill_at - 1]

    assert learner_ckpt.clean_incomplete(tmp_path) == [interrupted[0].name]
    assert learner_ckpt.latest_complete(tmp_path) == newest


def test_corrupt_checkpoint_is_skipped(tmp_path: Path):
    learner = Learner(LearnerConfig())
    saver = learner_ckpt.LearnerCheckpointer(learner_ckpt.LearnerCheckpointConfig(directory=str(tmp_path)))
    for step in (1, 2):
        learner.step = step
        saver.save_async(step, learner.snapshot())
    saver.wait()
    payload = tmp_path / "step-00000002" / learner_ckpt.PAYLOAD
    payload.write_bytes(payload.read_bytes()[:-10])
    assert learner_ckpt.latest_complete(tmp_path).name == "step-00000001"
