"""What a checkpoint may ask of its restore (issue 36, items 2 and 4): never more than the
restoring side's config, and nothing that can be checked is found out after the live
sandbox was fenced. Real containers, real CRIU; the manifests are edited as a writer of the
store could edit them.
"""

from __future__ import annotations

import pytest

from belayer_core.errors import RestoreFailed
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.restore.restore import full_restore
from belayer_env.sandbox.config import DEFAULT_CAPABILITIES, SandboxConfig
from belayer_env.store.manifest import read_manifest, write_manifest


def _edit_manifest(ck, **changes) -> None:
    data = read_manifest(ck.path)
    config = dict(data["config"])
    for key, value in changes.items():
        if key == "image_id":
            data["image_id"] = value
        else:
            config[key] = value
    data["config"] = config
    write_manifest(ck.path, {k: v for k, v in data.items() if k != "format"})


def _reload(store, ck):
    return store.get(ck.id)


def _assert_untouched(docker_client, sb) -> None:
    """The live sandbox still runs, the same container, and answers."""
    assert docker_client.api.inspect_container(sb.container_id)["State"]["Running"]
    assert sb.execute("echo alive")["output"].strip() == "alive"


@pytest.mark.parametrize(("changes", "named"), [
    ({"capabilities": [*DEFAULT_CAPABILITIES, "SYS_ADMIN"]}, "capabilities: SYS_ADMIN"),
    ({"network": True}, "network"),
    ({"memory": "2g"}, "memory"),
    ({"docker_host": "tcp://127.0.0.1:2375"}, "docker_host"),
], ids=["sys_admin", "network", "memory", "docker_host"])
def test_a_manifest_cannot_widen_the_sandbox(make_sandbox, ck_store, docker_client, changes, named):
    sb = make_sandbox()
    ck = full_checkpoint(sb, ck_store)
    _edit_manifest(ck, **changes)
    with pytest.raises(RestoreFailed, match=named):
        full_restore(_reload(ck_store, ck), client=docker_client)
    _assert_untouched(docker_client, sb)
    with pytest.raises(RestoreFailed, match=named):  # nor with the sandbox's own config
        full_restore(_reload(ck_store, ck), client=docker_client, config=sb.config)
    _assert_untouched(docker_client, sb)


def test_a_wider_checkpoint_restores_when_the_caller_allows_it(make_sandbox, ck_store, docker_client):
    caps = (*DEFAULT_CAPABILITIES, "SYS_PTRACE")
    sb = make_sandbox(capabilities=caps, memory="1500m")
    ck = full_checkpoint(sb, ck_store)
    with pytest.raises(RestoreFailed, match="capabilities: SYS_PTRACE.*memory: 1500m"):
        full_restore(ck, client=docker_client)  # the secure defaults allow neither
    restored = full_restore(ck, client=docker_client, config=SandboxConfig(capabilities=caps, memory="2g"))
    assert restored.config.capabilities == caps and restored.config.memory == "1500m"  # as recorded, not widened


def test_a_manifest_cannot_choose_another_image(make_sandbox, ck_store, docker_client):
    sb = make_sandbox()
    ck = full_checkpoint(sb, ck_store)
    other = docker_client.images.get("belayer-base:latest")
    tag = "belayer-trust-other:latest"
    other.tag(tag)  # the same bytes under another name: still not the restoring config's image name
    try:
        _edit_manifest(ck, image=tag, image_id="sha256:" + "0" * 64)
        with pytest.raises(RestoreFailed, match="was taken on image"):
            full_restore(_reload(ck_store, ck), client=docker_client)
    finally:
        docker_client.images.remove(tag)
    _assert_untouched(docker_client, sb)


def test_a_restore_docker_cannot_create_leaves_the_live_sandbox_running(make_sandbox, ck_store, docker_client):
    """Item 4: the create comes before the fence. The checkpoint names an image that is gone
    (allowed by the caller's config): Docker refuses the create, the sandbox lives on."""
    sb = make_sandbox()
    sb.execute("echo 7 > /tmp/mark")
    ck = full_checkpoint(sb, ck_store)
    original = (ck.path / "manifest.json").read_bytes()
    gone = "belayer-trust-gone:latest"
    _edit_manifest(ck, image=gone, image_id=gone)
    with pytest.raises(RestoreFailed, match="belayer-trust-gone"):
        full_restore(_reload(ck_store, ck), client=docker_client, config=sb.config.model_copy(update={"image": gone}))
    _assert_untouched(docker_client, sb)
    (ck.path / "manifest.json").write_bytes(original)  # the checkpoint as taken still restores
    restored = full_restore(ck, client=docker_client)
    assert restored.container_id != sb.container_id
    assert restored.execute("cat /tmp/mark")["output"].strip() == "7"
