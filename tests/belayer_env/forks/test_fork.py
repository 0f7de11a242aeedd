"""``fork``: N sandboxes from one checkpoint, each prefix-consistent and independent.

Real containers and CRIU: every fork carries a live HTTP server (its hit counter lives in
memory) and an append-only log written by a background process; writes made in one fork
after the fork are never seen in another one, nor in the sandbox the checkpoint came from.
Forks share the checkpoint's layer as a read-only overlay lower layer (copy-on-write): each
fork's tree is the checkpoint's, a checkpoint of a fork (both capture modes) holds the
fork's whole layer and restores to the fork's tree and processes, and ``belayer gc``
removes a shared layer once no container uses it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from belayer.cli import main as cli_main
from belayer_core.errors import RestoreFailed, UsageError
from belayer_core.procfs import mounts
from belayer_env import fork
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.criu import runtime
from belayer_env.ops.gc import list_managed, sweep_shared_layers
from belayer_env.restore import ctrd_copies, prestaging
from belayer_env.restore.cleanup import wait_cleaned
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox.fence import fence, sandbox_containers
from belayer_env.sandbox.treehash import tree_hash
from belayer_env.store import in_memory, shared_layer, shared_lease
from belayer_env.store.manifest import read_manifest_digest
from belayer_env.store.store import owner_tag
from tests.belayer_env.conftest_checkpoint import http_get, log_state, start_counter, start_server
from tests.conftest import wait_until


def _line_count(sb, path="/tmp/count.log") -> int:
    return int(sb.execute(f"wc -l < {path}")["output"].strip())


def test_fork_gives_independent_prefix_consistent_sandboxes(make_sandbox, ck_store, docker_client):
    src = make_sandbox()
    assert src.execute("mkdir -p /data && echo base > /data/shared")["returncode"] == 0
    start_counter(src)
    start_server(src)
    h0 = http_get(src)  # start_server's readiness probe counts too
    # the log only grows: read before the capture, a lower bound on it at the checkpoint (read
    # after, it was an upper bound, and a fork slower to restore than the source to publish
    # was behind it by more than the slack allowed: seen under load)
    logged_before = _line_count(src)
    ck = full_checkpoint(src, ck_store, 1)
    forks = fork(ck, 3, client=docker_client)
    try:
        assert len({f.name for f in forks}) == 3 and src.name not in {f.name for f in forks}
        # one shared copy of the layer under all of them; their own upperdirs start empty
        assert forks[0].shared_lower and {f.shared_lower for f in forks} == {forks[0].shared_lower}
        for i, f in enumerate(forks):
            assert f.restored_from == ck.id and f.is_alive()
            # prefix-consistent: the server's in-memory counter continues from the checkpoint,
            # the log is an unbroken 1..n sequence that continued past the checkpoint
            assert http_get(f) == h0 + 1
            n, unbroken = log_state(f)
            assert unbroken and n >= logged_before, (n, logged_before)
            assert f.execute("cat /data/shared")["output"] == "base\n"
            # independent writes after the fork: one file each, a different number of hits each
            assert f.execute(f"echo fork{i} > /data/shared && touch /data/only{i}")["returncode"] == 0
            for _ in range(i):
                http_get(f)
        for i, f in enumerate(forks):
            assert f.execute("cat /data/shared")["output"] == f"fork{i}\n"
            listing = f.execute("ls /data")["output"].split()
            assert listing == sorted(["shared", f"only{i}"]), listing
            assert http_get(f) == h0 + 2 + i  # its own hits only
            n, unbroken = log_state(f)
            assert unbroken
        # the source is untouched by all of it
        assert src.execute("cat /data/shared; ls /data")["output"] == "base\nshared\n"
        assert http_get(src) == h0 + 1
        # labelled like every sandbox: fenced by name, listed (owner alive) by gc
        managed = {c.sandbox: c for c in list_managed(docker_client)}
        for f in forks:
            assert [c["Id"] for c in sandbox_containers(docker_client, f.name)] == [f.container_id]
            assert f.name in managed and not managed[f.name].orphaned
    finally:
        for f in forks:
            fence(docker_client, f.name, background=False)
    for f in forks:
        assert not sandbox_containers(docker_client, f.name, by_name=True)
    # each fork's restore removed containerd's unpacked copy of its images (three at once, one checkpoint)
    assert wait_cleaned(), "a restore's clean-up thread did not finish"
    assert not [d for d, nonce in ctrd_copies.copies() if nonce.endswith(f"~{owner_tag()}")]


def test_fork_rejects_bad_arguments(make_sandbox, ck_store, docker_client):
    src = make_sandbox()
    ck = full_checkpoint(src, ck_store, 1)
    for n in (0, -1, True, 1.5, 10_000):
        with pytest.raises(UsageError):
            fork(ck, n, client=docker_client)
    with pytest.raises(UsageError):
        fork(ck, 2, client=docker_client, names=[src.name, "other"])  # would fence the source


def test_env_fork_returns_envs_at_the_same_boundary(make_env, docker_client):
    env = make_env(checkpoint_policy="always")
    env.reset(options={"task": "t", "setup": "mkdir -p /w && echo 0 > /w/n"})
    env.step("printf 'import http.server\\nclass H(http.server.SimpleHTTPRequestHandler):\\n"
             "    def log_message(self, *a): pass\\nhttp.server.HTTPServer((\"127.0.0.1\", 8000), H).serve_forever()\\n'"
             " > /srv.py && cd /w && setsid python3 /srv.py >/dev/null 2>&1 </dev/null &")
    env.step("echo a >> /w/log")
    children = env.fork(2)
    try:
        assert [len(c.trajectory.steps) for c in children] == [2, 2]
        assert all(c.trajectory.steps[-1].action == "echo a >> /w/log" for c in children)
        for i, c in enumerate(children):
            obs, *_ = c.step(f"echo fork{i} >> /w/log; cat /w/log")
            assert obs.endswith(f"a\nfork{i}\n</output>"), obs
            get = c.step("python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/log').read().decode())\"")[0]
            assert f"a\nfork{i}\n" in get, get  # the server (a live process of the fork) serves its own file system
        obs, *_ = env.step("cat /w/log")
        assert obs.endswith("<output>\na\n</output>"), obs
    finally:
        for c in children:
            c.close()
            assert not sandbox_containers(docker_client, c.name, by_name=True)


def _upper(docker_client, sb) -> Path:
    return Path(docker_client.api.inspect_container(sb.container_id)["GraphDriver"]["Data"]["UpperDir"])


def _shared_root(docker_client, name: str) -> Path:
    return shared_layer.lowers_root(prestaging.docker_root(docker_client)) / name


# the origin's layer: files, a whiteout over an image file, an opaque directory over an
# image directory, a symlink, a sparse file, a directory only the layer has
ORIGIN_SETUP = ("mkdir -p /w/sub/deep && echo base > /w/a && echo keep > /w/sub/deep/k && ln -s a /w/link"
                " && truncate -s 1M /w/sparse && rm /etc/issue && rm -rf /usr/share/doc"
                " && mkdir /usr/share/doc && echo mine > /usr/share/doc/only")
FORK_WRITES = ("echo changed > /w/a && rm /w/link && rm -rf /w/sub && mkdir /w/sub && echo new > /w/sub/n"
               " && rm /usr/share/doc/only && mkdir -p /w/new/d && echo x > /w/new/d/f && chmod 700 /w/new")


def test_forks_share_the_layer_and_their_checkpoints_restore_to_the_fork(make_sandbox, ck_store, docker_client):
    src = make_sandbox()
    assert src.execute(ORIGIN_SETUP)["returncode"] == 0
    start_server(src)
    h0 = http_get(src)
    ck = full_checkpoint(src, ck_store, 1)
    at_ck = tree_hash(src)  # nothing in the source writes files: its tree is the checkpoint's
    forks = fork(ck, 2, client=docker_client)
    restored = []
    try:
        shared = _shared_root(docker_client, forks[0].shared_lower)
        assert (shared / "diff" / "w" / "a").read_text() == "base\n"
        assert [tree_hash(f) for f in forks] == [at_ck, at_ck]
        assert not any((_upper(docker_client, f) / "w").exists() for f in forks)  # nothing copied per fork
        # fork 0 rewrites, deletes and replaces what the shared layer holds; nobody else sees it
        assert forks[0].execute(FORK_WRITES)["returncode"] == 0
        assert http_get(forks[0]) == h0 + 1 and http_get(forks[0]) == h0 + 2
        assert (shared / "diff" / "w" / "a").read_text() == "base\n"  # copy-on-write: the shared copy is intact
        assert tree_hash(forks[1]) == at_ck and tree_hash(src) == at_ck
        assert forks[1].execute("cat /w/a /w/sub/deep/k /usr/share/doc/only")["output"] == "base\nkeep\nmine\n"
        assert http_get(forks[1]) == h0 + 1
        mid = tree_hash(forks[0])
        assert mid != at_ck
        # a checkpoint of the fork, either capture mode, holds its whole layer (shared + own)
        for i, mode in enumerate(("incremental", "paused")):
            ck_f = full_checkpoint(forks[0], ck_store, 2 + i, capture=mode)
            back = full_restore(ck_f, client=docker_client, name=f"{forks[0].name}-r{i}")
            restored.append(back)
            assert back.shared_lower is None  # a plain restore: a layer of its own
            assert tree_hash(back) == mid, mode
            assert http_get(back) == h0 + 3  # the fork's server at the checkpoint (h0 + 2), its own count
            assert back.execute("cat /w/a /w/sub/n; ls /w/sub; test -e /w/link || echo nolink")["output"] == \
                "changed\nnew\nn\nnolink\n"
        # the fork's next (incremental, from its own mirror) capture after more writes
        assert forks[0].execute("echo more >> /w/a && rm -rf /w/new")["returncode"] == 0
        later = tree_hash(forks[0])
        ck_g = full_checkpoint(forks[0], ck_store, 4, capture="incremental")
        back = full_restore(ck_g, client=docker_client, name=f"{forks[0].name}-r2")
        restored.append(back)
        assert tree_hash(back) == later and http_get(back) == h0 + 3
    finally:
        for sb in [*forks, *restored]:
            fence(docker_client, sb.name, background=False)


def test_gc_removes_shared_layers_no_container_uses(make_sandbox, ck_store, docker_client, capsys):
    src = make_sandbox()
    assert src.execute("mkdir -p /w && echo 1 > /w/f")["returncode"] == 0
    ck = full_checkpoint(src, ck_store, 1)
    forks = fork(ck, 2, client=docker_client)
    name = forks[0].shared_lower
    root = _shared_root(docker_client, name)
    link = root.parent.parent / "overlay2" / "l" / (root / "link").read_text()
    try:
        assert link.resolve() == (root / "diff").resolve()
        fence(docker_client, forks[0].name, background=False)
        assert name not in sweep_shared_layers(docker_client) and root.is_dir()  # fork 1 still runs on it
        assert forks[1].execute("cat /w/f")["output"] == "1\n"
    finally:
        for f in forks:
            fence(docker_client, f.name, background=False)
    # no container uses it now; a fork being made from it (its lease) still keeps it
    data, digest = read_manifest_digest(Path(ck.path))
    with shared_lease.lease(docker_client, ck, prestaging.docker_root(docker_client), data, digest) as held:
        assert held is not None and held.name == name
        assert name not in sweep_shared_layers(docker_client) and root.is_dir()
    assert cli_main(["gc", "--dry-run", "--json"]) == 0  # lists it, removes nothing
    assert name in json.loads(capsys.readouterr().out)["shared_layers"] and root.is_dir() and link.is_symlink()
    assert cli_main(["gc", "--json"]) == 0
    assert name in json.loads(capsys.readouterr().out)["shared_layers"]
    assert not root.exists() and not os.path.lexists(link)


def test_fork_without_sharing_gives_each_fork_its_own_layer(make_sandbox, ck_store, docker_client):
    src = make_sandbox()
    assert src.execute("mkdir -p /w && echo 1 > /w/f")["returncode"] == 0
    ck = full_checkpoint(src, ck_store, 1)
    at_ck = tree_hash(src)
    forks = fork(ck, 2, client=docker_client, share=False)
    try:
        assert [f.shared_lower for f in forks] == [None, None]
        assert (_upper(docker_client, forks[0]) / "w" / "f").read_text() == "1\n"
        assert [tree_hash(f) for f in forks] == [at_ck, at_ck]
    finally:
        for f in forks:
            fence(docker_client, f.name, background=False)


def test_a_layer_with_hardlinks_is_forked_with_a_copy_each(make_sandbox, ck_store, docker_client):
    # a shared lower would split a hardlink on the first write through one of its names
    src = make_sandbox(disk=None)  # and the path without a disk cap
    assert src.execute("mkdir -p /w && echo 1 > /w/a && ln /w/a /w/b")["returncode"] == 0
    ck = full_checkpoint(src, ck_store, 1)
    at_ck = tree_hash(src)
    forks = fork(ck, 2, client=docker_client, config=src.config)  # uncapped: wider than the defaults
    try:
        assert [f.shared_lower for f in forks] == [None, None]
        assert [tree_hash(f) for f in forks] == [at_ck, at_ck]
        assert forks[0].execute("echo 2 >> /w/a && cat /w/b")["output"] == "1\n2\n"  # still one file, two names
        assert forks[1].execute("cat /w/b")["output"] == "1\n"
    finally:
        for f in forks:
            fence(docker_client, f.name, background=False)
    sweep_shared_layers(docker_client)


def test_uncapped_forks_share_too(make_sandbox, ck_store, docker_client):
    src = make_sandbox(disk=None)
    assert src.execute(ORIGIN_SETUP)["returncode"] == 0
    ck = full_checkpoint(src, ck_store, 1)
    at_ck = tree_hash(src)
    forks = fork(ck, 2, client=docker_client, config=src.config)
    try:
        assert forks[0].shared_lower is not None
        assert [tree_hash(f) for f in forks] == [at_ck, at_ck]
        assert forks[0].execute(FORK_WRITES)["returncode"] == 0
        assert tree_hash(forks[1]) == at_ck
        mid = tree_hash(forks[0])
        back = full_restore(full_checkpoint(forks[0], ck_store, 2), client=docker_client, name=f"{forks[0].name}-r",
                            config=src.config)
        forks.append(back)
        assert tree_hash(back) == mid
    finally:
        for f in forks:
            fence(docker_client, f.name, background=False)
    sweep_shared_layers(docker_client)


def _mounted(path: Path, source: str | None = None) -> bool:
    """``path`` is a mount point (made by ``source``: ``in_memory.FORK``, ... when given)."""
    return any(m.target == str(path) and source in (None, m.source) for m in mounts())


@pytest.mark.parametrize("where", ["memory", "disk"])
def test_the_shared_copy_in_memory_or_on_disk(make_sandbox, ck_store, docker_client, monkeypatch, where):
    # in memory (a tmpfs of its own, the default where it fits) or on Docker's disk: the same
    # tree in every fork, copy-on-write, and gc unmounts and removes it once unused
    monkeypatch.setattr(in_memory, "LOWER_MODE", where)
    src = make_sandbox()
    assert src.execute(ORIGIN_SETUP)["returncode"] == 0
    ck = full_checkpoint(src, ck_store, 1)
    at_ck = tree_hash(src)
    forks = fork(ck, 2, client=docker_client)
    root = _shared_root(docker_client, forks[0].shared_lower)
    try:
        assert _mounted(root / "diff", in_memory.FORK) == (where == "memory")
        assert [tree_hash(f) for f in forks] == [at_ck, at_ck]
        assert forks[0].execute(FORK_WRITES)["returncode"] == 0
        assert tree_hash(forks[1]) == at_ck and (root / "diff" / "w" / "a").read_text() == "base\n"
    finally:
        for f in forks:
            fence(docker_client, f.name, background=False)
    assert root.name in sweep_shared_layers(docker_client)
    assert not root.exists() and not _mounted(root / "diff")


def test_forks_get_their_image_links_in_memory(make_sandbox, ck_store, docker_client, monkeypatch):
    """Each fork's links to the images verified once for all forks are made beside them, in
    their tmpfs (a symlink on Docker's ext4 cost ~0.4 ms of CPU here, 60+ per fork), handed
    to Docker through the container's checkpoints directory (a symlink for the start, an
    empty directory again after), and gone with that tmpfs."""
    src = make_sandbox()
    start_counter(src, heap_mib=4)
    ck = full_checkpoint(src, ck_store, 1)
    root = Path(prestaging.docker_root(docker_client))
    seen: dict[str, tuple[bool, str, bool]] = {}
    start_from = runtime.start_from

    def observed(client, cid, name):  # what Docker finds at the start (the real start follows)
        own = root / "containers" / cid / "checkpoints"
        seen[cid] = (own.is_symlink(), os.readlink(own) if own.is_symlink() else "",
                     own.is_symlink() and (own / name / "pages-1.img").resolve().is_file())
        return start_from(client, cid, name)

    monkeypatch.setattr(runtime, "start_from", observed)
    forks = fork(ck, 2, client=docker_client)
    try:
        assert wait_cleaned()
        for f in forks:
            linked, target, pages = seen[f.container_id]
            assert linked and pages, f"fork {f.name}: images handed over from Docker's disk ({seen})"
            assert Path(target).name.startswith(".links-"), target
            assert Path(target).parent.name.startswith(f"{prestaging.PREFIX}fork-"), target
            assert not Path(target).exists(), f"{target}: the fork's links outlived its images' tmpfs"
            own = root / "containers" / f.container_id / "checkpoints"
            assert own.is_dir() and not own.is_symlink() and not any(own.iterdir()), own
            wait_until(lambda f=f: log_state(f)[1] and log_state(f)[0] > 0, 30, f"fork {f.name} counter consistent")
        assert not [d for d in prestaging.docker_tmp(docker_client).glob(f"{prestaging.PREFIX}*~{owner_tag()}")
                    if "-staged-" not in d.name]
    finally:
        for f in forks:
            fence(docker_client, f.name, background=False)


@pytest.mark.parametrize("artifact", ["layer", "images"])
def test_a_corrupt_checkpoint_forks_into_nothing(make_sandbox, ck_store, docker_client, artifact):
    # the forks' containers are created while the layer and the images are verified: a
    # disagreement with the manifest still starts nothing and leaves no fork behind
    src = make_sandbox()
    assert src.execute("mkdir -p /w && echo 1 > /w/f")["returncode"] == 0
    ck = full_checkpoint(src, ck_store, 1)
    victim = (ck.path / "layer.tar" if artifact == "layer" else
              max((ck.path / "runtime").glob("pages-*.img"), key=lambda p: p.stat().st_size))
    with open(victim, "r+b") as f:
        f.seek(600)
        byte = f.read(1)
        f.seek(600)
        f.write(bytes([byte[0] ^ 0xFF]))
    names = [f"{src.name}-bad{i}" for i in range(3)]
    with pytest.raises(RestoreFailed) as e:
        fork(ck, 3, client=docker_client, names=names, fresh_names=True)
    assert e.value.checkpoint == ck.id
    for name in names:
        assert not sandbox_containers(docker_client, name, by_name=True)
        assert not docker_client.api.containers(all=True, filters={"name": f"{name}-restoring"})
    assert src.is_alive() and src.execute("cat /w/f")["output"] == "1\n"
    sweep_shared_layers(docker_client)


KILLED_AFTER_IMAGES = """
import os, signal, sys
from pathlib import Path
from belayer_env.forks import ahead as fork_ahead
from belayer_env.store.store import CheckpointStore
from belayer_env.store.manifest import read_manifest_digest
from belayer_env.sandbox.docker_api import connect
ck = CheckpointStore(Path(sys.argv[1])).get(sys.argv[2])
data, _ = read_manifest_digest(Path(ck.path))
print(fork_ahead.verified_images(ck, connect(), data), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_gc_reaps_the_images_a_killed_forker_left_in_memory(make_sandbox, ck_store, docker_client):
    src = make_sandbox()
    ck = full_checkpoint(src, ck_store, 1)
    p = subprocess.run([sys.executable, "-c", KILLED_AFTER_IMAGES, str(ck_store.path), ck.id], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    left = Path(p.stdout.strip())
    assert left.is_dir() and any(left.iterdir())
    if in_memory.memory_allowed(1 << 20):
        assert _mounted(left, in_memory.FORK)  # the verified images in a tmpfs of their own
    sweep_shared_layers(docker_client)  # what `belayer gc` runs
    assert not left.exists() and not _mounted(left)
