"""Arena server as a real process: describe, health, updates, socket mode, cleanup."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from belayer_core.errors import ArenaLost, UsageError
from belayer_engine.arena.client import ArenaClient
from belayer_engine.model.config import ModelConfig
from belayer_engine.model.weights import init_weights

from .conftest import Arena, poll


def test_describe_health_and_permissions(tmp_path, procs):
    arena = Arena(tmp_path, "--num-blocks", "32")
    procs.append(arena)
    d = arena.client.describe()
    assert d["version"] == 0 and d["kv"]["num_blocks"] == 32
    assert ModelConfig(**d["model"]) == ModelConfig()
    assert stat.S_IMODE(os.stat(arena.socket).st_mode) == 0o600
    for h in d["regions"].values():
        assert h["kind"] == "shm" and stat.S_IMODE(os.stat(h["path"]).st_mode) == 0o600
    h = arena.client.health()
    assert h["status"] == "ok" and h["device_ok"] and h["owner_pid"] == arena.pid


def test_update_weights_versions_and_errors(tmp_path, procs):
    arena = Arena(tmp_path)
    procs.append(arena)
    c = arena.client
    before = c.checksums()
    w = init_weights(ModelConfig(), 5)
    assert c.update_weights(w) == 1
    after = c.checksums()
    assert after["w1"] != before["w1"] and after["w0"] == before["w0"]  # written into the free slot
    assert c.update_weights({"model.norm.weight": w["model.norm.weight"] * 2}) == 2
    assert c.checksums()["w1"] == after["w1"]  # slot of version 1 untouched by version 2
    with pytest.raises(UsageError, match="unknown weight"):
        c.update_weights({"nope": torch.zeros(2)})
    with pytest.raises(UsageError, match="shape"):
        c.update_weights({"model.norm.weight": torch.zeros(3)})
    assert c.describe()["version"] == 2
    # an explicit version (an engine's version given to a fresh arena): newer ones only
    with pytest.raises(UsageError, match="not newer"):
        c.update_weights({"model.norm.weight": w["model.norm.weight"]}, version=2)
    assert c.update_weights({"model.norm.weight": w["model.norm.weight"]}, version=7) == 7
    assert c.describe()["version"] == 7 and c.update_weights({}) == 8


def test_shutdown_removes_shared_memory(tmp_path, procs):
    arena = Arena(tmp_path)
    procs.append(arena)
    paths = [h["path"] for h in arena.client.describe()["regions"].values()]
    arena.client.shutdown()
    poll(lambda: not arena.alive(), 20, "arena to exit after shutdown")
    assert not any(Path(p).exists() for p in paths)
    assert not Path(arena.socket).exists()
    with pytest.raises(ArenaLost):
        ArenaClient(arena.socket, timeout=2).health()


def test_gc_reaps_the_shm_files_of_a_killed_arena_only(tmp_path, procs):
    """A SIGKILLed arena leaves its weights/KV files in /dev/shm; ``belayer gc`` removes
    exactly those (``--dry-run`` only lists them), never a live arena's."""
    import json
    import os
    import subprocess
    import sys

    from belayer_engine.arena.shm_files import SHM_PREFIX

    # A private shm directory: on a shared machine any other arena that starts reaps the
    # files of dead arenas in /dev/shm, which would race with the dry run below.
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"BELAYER_SHM_DIR": str(shm)}

    def files_of(pid: int) -> set[str]:
        return {str(p) for p in shm.glob(f"{SHM_PREFIX}{pid}-*")}

    (tmp_path / "dead").mkdir()
    (tmp_path / "live").mkdir()
    dead, live = Arena(tmp_path / "dead", env=env), Arena(tmp_path / "live", env=env)
    procs += [dead, live]
    dead_pid = dead.pid
    left, kept = files_of(dead_pid), files_of(live.pid)
    assert left and kept, "arenas on CPU keep their memory in shm files"
    dead.kill9()

    def gc(*flags: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "belayer", "gc", "--json", *flags],
                           capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    assert left <= set(gc("--dry-run")["arena_files"]) and files_of(dead_pid) == left
    assert left <= set(gc()["arena_files"])
    assert not files_of(dead_pid), "the dead arena's files are still there"
    assert files_of(live.pid) == kept, "a live arena's files were touched"


def _fetch_weight_cache(path: str) -> dict[str, torch.Tensor]:
    """SGLang's own request on the weight-cache socket; the tensors mapped here (no copy)."""
    import base64
    import io
    import pickle
    import socket
    import struct

    torch.multiprocessing.set_sharing_strategy("file_system")
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        req = pickle.dumps({"type": "fetch_state", "config": {"tp_size": 1, "pp_size": 1}})
        s.sendall(struct.pack("!I", len(req)) + req)
        (n,) = struct.unpack("!I", s.recv(4, socket.MSG_WAITALL))
        reply = pickle.loads(s.recv(n, socket.MSG_WAITALL))
    assert reply["status"] == "ok"
    return {k: pickle.load(io.BytesIO(base64.b64decode(e["handle"]))) for k, e in reply["entries"].items()}


SGLANG_ARENA = "belayer_engine.backends.sglang.arena"  # the arena with SGLang's weight cache plugged in


def test_an_sglang_only_arena_holds_the_weights_once(tmp_path, procs):
    """--no-reference-slots: no weight slots, no KV region; the SGLang layout is the only
    copy, updates land in it in place under a new version, reference workers are refused."""
    wsock = str(tmp_path / "wcache.sock")
    arena = Arena(tmp_path, "--weight-cache-socket", wsock, "--no-reference-slots", module=SGLANG_ARENA)
    procs.append(arena)
    c = arena.client
    d = c.describe()
    assert d["regions"] == {} and d["weight_cache"]["nbytes"] > 0
    assert "model.norm.weight" in d["layout"]  # HF names and shapes for learners, as before
    maps = Path(f"/proc/{arena.pid}/maps").read_text()
    assert "belayer-arena-" not in maps  # no slot or KV file mapped: one copy, SGLang's
    assert set(c.checksums()) == {"weight_cache"}

    cached = _fetch_weight_cache(wsock)
    norm = cached["model.norm.weight"]
    w = init_weights(ModelConfig(), 5)
    assert not torch.equal(norm, w["model.norm.weight"])
    before = c.checksums()["weight_cache"]
    assert c.update_weights({"model.norm.weight": w["model.norm.weight"]}) == 1
    assert torch.equal(norm, w["model.norm.weight"])  # written in place into the mapped tensor
    assert c.checksums()["weight_cache"] != before and c.describe()["version"] == 1
    with pytest.raises(UsageError, match="unknown weight"):
        c.update_weights({"nope": torch.zeros(2)})
    with pytest.raises(UsageError, match="shape"):
        c.update_weights({"model.norm.weight": torch.zeros(3)})
    with pytest.raises(UsageError, match="not newer"):
        c.update_weights({"model.norm.weight": norm.clone()}, version=1)
    assert c.describe()["version"] == 1 and c.weight_cache()["version"] == 1
    with pytest.raises(UsageError, match="no reference-worker slots"):
        c.attach("active", "w", lambda version, slot: None)


def test_an_arena_without_any_weights_is_refused(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "belayer_engine.arena", "--socket", str(tmp_path / "a.sock"),
                          "--no-reference-slots"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "would hold no weights" in out.stderr
    plain = subprocess.run([sys.executable, "-m", "belayer_engine.arena", "--socket", str(tmp_path / "b.sock"),
                            "--weight-cache-socket", str(tmp_path / "w.sock")], capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 2 and "unrecognized arguments: --weight-cache-socket" in plain.stderr


def test_the_cuda_stack_limit_is_an_arena_option_and_a_no_op_on_cpu():
    """GPU arenas shrink their context's per-thread stack reservation (256 bytes: ~200 MB of
    an H200's context, measured); on CPU nothing is touched and describe() says so."""
    from pydantic import ValidationError

    from belayer_engine.arena.config import ArenaConfig
    from belayer_engine.arena.cuda_limits import set_thread_stack

    assert ArenaConfig(socket="s").cuda_stack_bytes == 256
    with pytest.raises(ValidationError, match="cuda_stack_bytes"):
        ArenaConfig(socket="s", cuda_stack_bytes=-1)
    assert set_thread_stack(torch.device("cpu"), 256) is None
    assert set_thread_stack(torch.device("cuda:0"), 0) is None  # 0: the driver's default, no CUDA call
