"""Probe (issue 15): how fast is a CRIU restore through runc directly, off Docker's start path?

Not the product's restore: a measurement for the decision. It checkpoints a sandbox with
Belayer (``full_checkpoint``), prepares everything a restore needs beforehand and untimed
(an overlay rootfs of the image's lower layers + the checkpoint's layer, a bundle with the
source container's OCI spec, its cgroup path moved to ``/belayer-probe/<id>``, hooks
dropped; the CRIU images), then times only ``runc restore --detach`` and checks the
restored container runs with the checkpoint's file. Everything it makes is removed
(runc container, mount, cgroups, dirs, the source sandbox).

Run: ``python benchmarks/runc_restore_probe.py [--heavy] [--runs 3]`` (root, Docker, CRIU).
Compare with the ``started`` phase of ``full_restore`` (Docker's ``start?checkpoint=``) at
the same load: measured here at load ~7, a 50 MiB-heap sandbox restored in 0.22 s through
runc against 1.2-1.3 s through Docker.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from belayer_env import DockerSandbox  # noqa: E402
from belayer_env.capture.checkpoint import full_checkpoint
from belayer_env.restore.prestaging import docker_root  # noqa: E402
from belayer_env.sandbox.docker_api import connect  # noqa: E402
from belayer_env.sandbox.fence import fence
from belayer_env.store import layer
from belayer_env.store.manifest import read_manifest_digest  # noqa: E402
from belayer_env.store.store import CheckpointStore  # noqa: E402

BUNDLES = "/run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby"
HEAP = "setsid python3 -c 'import os,time; h=bytearray(os.urandom(50<<20)); time.sleep(1e9)' >/dev/null 2>&1 </dev/null & sleep 3"


def probe_once(client, heavy: bool) -> float:
    store = CheckpointStore(Path(tempfile.mkdtemp(prefix="belayer-probe-store-")))
    sb = DockerSandbox(client=client, name_prefix="belayer-probe")
    rid = f"belayer-probe-{uuid.uuid4().hex[:8]}"
    root = Path(tempfile.mkdtemp(prefix="belayer-probe-runc-", dir="/run"))
    work = Path(tempfile.mkdtemp(prefix="belayer-probe-", dir=Path(docker_root(client)) / "tmp"))
    merged = work / "merged"
    try:
        if heavy:
            sb.execute(HEAP)
        sb.execute("echo hello > /state; setsid sleep 1000 >/dev/null 2>&1 </dev/null &")
        ck = full_checkpoint(sb, store, 1)
        data, _ = read_manifest_digest(Path(ck.path))
        info = client.api.inspect_container(sb.container_id)
        spec = json.loads((Path(BUNDLES) / sb.container_id / "config.json").read_text())
        upper, wd, bundle = work / "upper", work / "work", work / "bundle"
        for d in (upper, wd, merged, bundle):
            d.mkdir()
        layer.install(Path(ck.path) / "layer.tar", upper, data["files"]["layer.tar"])
        lower = info["GraphDriver"]["Data"]["LowerDir"]
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={upper},workdir={wd}", str(merged)], check=True)
        images = work / "images"
        shutil.copytree(Path(ck.path) / "runtime", images)
        spec["root"]["path"] = str(merged)
        spec["linux"]["cgroupsPath"] = f"/belayer-probe/{rid}"
        spec.pop("hooks", None)
        (bundle / "config.json").write_text(json.dumps(spec))
        conf = work / "criu.conf"
        conf.write_text("network-lock skip\n")
        with open(work / "runc.out", "w+") as out:  # a file, not a pipe: the restored tree inherits it
            t0 = time.monotonic()
            r = subprocess.run(["runc", "--root", str(root), "restore", "--detach", "--tcp-established",
                                "--file-locks", "--bundle", str(bundle), "--image-path", str(images),
                                "--work-path", str(work / "w"), rid],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=out, timeout=60,
                               env={**os.environ, "CRIU_CONFIG_FILE": str(conf)})
            elapsed = time.monotonic() - t0
        if r.returncode != 0:
            raise RuntimeError(f"runc restore failed: {(work / 'runc.out').read_text()[-500:]}")
        state = json.loads(subprocess.run(["runc", "--root", str(root), "state", rid], capture_output=True,
                                          text=True, check=True).stdout)
        assert state["status"] == "running"
        assert Path(f"/proc/{state['pid']}/root/state").read_text() == "hello\n"
        return elapsed
    finally:
        subprocess.run(["runc", "--root", str(root), "delete", "--force", rid], capture_output=True)
        subprocess.run(["umount", str(merged)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
        for cg in Path("/sys/fs/cgroup").glob("*/belayer-probe"):
            for d in sorted(cg.rglob("*"), key=lambda p: -len(p.parts)) + [cg]:
                if d.is_dir():
                    with contextlib.suppress(OSError):
                        d.rmdir()
        fence(client, sb.name, background=False)
        shutil.rmtree(store.path, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heavy", action="store_true", help="a python process with a 50 MiB random heap")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    client = connect()
    for i in range(args.runs):
        s = probe_once(client, args.heavy)
        print(f"run {i + 1}: runc restore {s * 1e3:.0f} ms (load {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
