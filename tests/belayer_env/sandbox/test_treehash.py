"""tree_hash sees what a process could read (paths, types, modes, owners, contents, links)."""

from __future__ import annotations

import pytest

from belayer_env.sandbox.treehash import tree_hash


@pytest.mark.parametrize("change", [
    "echo changed > /w/f",
    "chmod 600 /w/f",
    "chown 7:7 /w/f",
    "ln -sfn f2 /w/l",
    "rm /w/gone",
    "touch /w/new",
    "rm /w/h && cp /w/f /w/h",  # same content, no longer a hardlink
])
def test_tree_hash_sees_each_kind_of_change(sandbox, change):
    sandbox.execute("mkdir /w && echo a > /w/f && ln -s f /w/l && touch /w/gone && ln /w/f /w/h")
    before = tree_hash(sandbox, root="/w")
    assert tree_hash(sandbox, root="/w") == before
    assert sandbox.execute("touch -d 2001-01-01 /w/f")["returncode"] == 0  # timestamps do not count
    assert tree_hash(sandbox, root="/w") == before
    assert sandbox.execute(change)["returncode"] == 0
    assert tree_hash(sandbox, root="/w") != before


def test_tree_hash_equal_across_fresh_sandboxes(sandbox, docker_client):
    from belayer_env import DockerSandbox

    with DockerSandbox(client=docker_client) as other:
        assert tree_hash(sandbox, root="/usr/lib/python3") == tree_hash(other, root="/usr/lib/python3")
