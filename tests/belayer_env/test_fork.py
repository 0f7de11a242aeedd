"""``fork``: N sandboxes from one checkpoint, each prefix-consistent and independent.

Real containers and CRIU: every fork carries a live HTTP server (its hit counter lives in
memory) and an append-only log written by a background process; writes made in one fork
after the fork are never seen in another one, nor in the sandbox the checkpoint came from.
"""

from __future__ import annotations

import pytest

from belayer.errors import UsageError
from belayer_env import fork
from belayer_env.checkpoint import fence, full_checkpoint
from belayer_env.fence import sandbox_containers
from belayer_env.gc import list_managed
from tests.belayer_env.conftest_checkpoint import http_get, log_state, start_counter, start_server


def _line_count(sb, path="/tmp/count.log") -> int:
    return int(sb.execute(f"wc -l < {path}")["output"].strip())


def test_fork_gives_independent_prefix_consistent_sandboxes(make_sandbox, ck_store, docker_client):
    src = make_sandbox()
    assert src.execute("mkdir -p /data && echo base > /data/shared")["returncode"] == 0
    start_counter(src)
    start_server(src)
    h0 = http_get(src)  # start_server's readiness probe counts too
    ck = full_checkpoint(src, ck_store, 1)
    at_ck = _line_count(src)  # a lower bound on the log at the checkpoint: it only grows
    forks = fork(ck, 3, client=docker_client)
    try:
        assert len({f.name for f in forks}) == 3 and src.name not in {f.name for f in forks}
        for i, f in enumerate(forks):
            assert f.restored_from == ck.id and f.is_alive()
            # prefix-consistent: the server's in-memory counter continues from the checkpoint,
            # the log is an unbroken 1..n sequence that continued past the checkpoint
            assert http_get(f) == h0 + 1
            n, unbroken = log_state(f)
            assert unbroken and n >= at_ck - 5, (n, at_ck)
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
