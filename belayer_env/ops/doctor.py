"""Readiness checks for the environment half: each says what is wrong and how to fix it."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

from belayer_core.procfs import mount_of
from belayer_env.sandbox import mounting
from belayer_env.sandbox.config import DEFAULT_IMAGE

SETUP = "bash scripts/setup.sh"
MIN_FREE_GIB = 5.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True

    def to_dict(self) -> dict:
        return asdict(self)


def _run(argv: list[str], timeout: float = 60) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(argv)}: timed out after {timeout:g} s"
    return p.returncode, (p.stdout + p.stderr).strip()


def check_docker() -> list[Check]:
    from belayer_core.errors import DaemonUnavailable
    from belayer_env.sandbox.docker_api import connect, docker_url

    try:
        client = connect(timeout=15)
        info = client.info()
    except DaemonUnavailable as e:
        fix = f"run `{SETUP}` (installs docker.io and starts dockerd)"
        return [Check("docker engine", False, str(e), fix),
                Check("docker experimental", False, "engine not reachable", fix),
                Check("base image", False, "engine not reachable", fix)]
    checks = [Check("docker engine", True, f"{docker_url()} server {info.get('ServerVersion')}, "
                    f"storage {info.get('Driver')}, cgroup v{info.get('CgroupVersion', '?')}",
                    f"run `{SETUP}` (installs docker.io and starts dockerd)")]
    exp = bool(info.get("ExperimentalBuild"))
    checks.append(Check("docker experimental", exp, "on" if exp else "off (checkpoints need it)",
                        'set {"experimental": true} in /etc/docker/daemon.json and restart dockerd '
                        f"(`{SETUP}` does it)"))
    drv = info.get("Driver")
    checks.append(Check("docker storage overlay2", drv == "overlay2", f"driver {drv}",
                        "configure dockerd with the overlay2 storage driver (layer capture reads its upperdir)"))
    try:
        img = client.images.get(DEFAULT_IMAGE)
        checks.append(Check("base image", True, f"{DEFAULT_IMAGE} ({img.attrs.get('Size', 0) / 1e6:.0f} MB)",
                            f"run `{SETUP}` (builds it with debootstrap)"))
    except Exception:
        checks.append(Check("base image", False, f"{DEFAULT_IMAGE} not found", f"run `{SETUP}` (builds it with debootstrap)"))
    root = info.get("DockerRootDir") or "/var/lib/docker"
    checks.append(check_disk(root))
    return checks


def check_disk(path: str) -> Check:
    probe = path if os.path.exists(path) else "/"
    free = shutil.disk_usage(probe).free / 2**30
    return Check("free disk", free >= MIN_FREE_GIB, f"{free:.1f} GiB free under {probe}",
                 f"free at least {MIN_FREE_GIB:g} GiB (docker image prune; belayer checkpoints rm; belayer gc)")


def check_criu() -> list[Check]:
    fix = f"run `{SETUP}` (builds CRIU >= 4.2 from Debian's sid source package)"
    criu = shutil.which("criu")
    if not criu:
        return [Check("criu >= 4.2", False, "criu not found in PATH", fix),
                Check("criu check", False, "criu not found", fix)]
    rc, out = _run([criu, "--version"])
    m = re.search(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", out)
    version = tuple(int(x) for x in m.groups() if x is not None) if m else ()
    vtext = ".".join(map(str, version)) or "unknown"
    checks = [Check("criu >= 4.2", version >= (4, 2), f"{criu} version {vtext}",
                    fix + " — Debian 13's 4.1 cannot dump sockets on kernels >= 6.16")]
    rc, out = _run([criu, "check"])
    checks.append(Check("criu check", rc == 0, out.splitlines()[-1] if out else f"exit {rc}", fix))
    pycriu = importlib.util.find_spec("pycriu") is not None
    checks.append(Check("pycriu", pycriu, "importable" if pycriu else "not importable", fix, required=False))
    checks.append(check_loopback_hook())
    checks.append(check_kdat_cache(criu))
    return checks


def check_loopback_hook() -> Check:
    """Sandboxes without network skip Docker's network stack only with this hook (``loopback``)."""
    from belayer_env.host import loopback

    ok = loopback.installed()
    if ok and not loopback.relays():
        return Check("criu loopback hook", False, f"{loopback.HOOK_PATH} ({loopback.hook_kind()}) listed in "
                     f"{loopback.RUNC_CRIU_CONF}, but it does not relay dumps: each dump runs a shell script of "
                     "its own too (a few ms more per freeze)", f"run `{SETUP}` (builds it; needs gcc)",
                     required=False)
    return Check("criu loopback hook", ok,
                 f"{loopback.HOOK_PATH} ({loopback.hook_kind()}, relays dumps) listed in {loopback.RUNC_CRIU_CONF}"
                 if ok else "not installed: sandboxes keep Docker's network stack (~0.1 s more per start and "
                 "restore)", f"run `{SETUP}`", required=False)


def check_kdat_cache(criu: str) -> Check:
    """CRIU keeps its kernel probing only on a tmpfs; setup builds it to use /run/criu."""
    try:
        with open(criu, "rb") as f:
            binary = f.read()
    except OSError:
        binary = b""
    where = next((d for d in ("/run/criu", "/run") if f"{d}/criu.kdat".encode() in binary), None)
    ok = where is not None and _is_tmpfs(where)
    return Check("criu kernel-probe cache", ok,
                 f"{where}/criu.kdat on tmpfs" if ok else
                 f"{where or 'its run dir'} is not a tmpfs: CRIU probes the kernel on every dump and restore (~30 ms)",
                 f"run `{SETUP}` (builds CRIU to cache in /run/criu and mounts a tmpfs there)", required=False)


def check_ctrd_copies() -> Check:
    """containerd never removes its unpacked copy of a restored checkpoint (``ctrd_copies``):
    each restore removes its own; a process killed mid-restore leaves one for ``belayer gc``."""
    from belayer_env.restore import ctrd_copies

    left = ctrd_copies.sweep(dry_run=True)
    where = ", ".join(str(d) for d in ctrd_copies.temp_dirs()) or "no containerd visible"
    return Check("containerd copies", not left,
                 f"none left by dead restores ({where})" if not left else
                 f"{len(left)} left by restores whose process is gone, in {where}",
                 "belayer gc", required=False)


def _is_tmpfs(path: str) -> bool:
    mount = mount_of(path)
    return mount is not None and mount.fstype == "tmpfs"


def check_kernel() -> list[Check]:
    cr = os.path.exists("/proc/sys/kernel/ns_last_pid") and os.path.exists("/proc/self/map_files")
    with open("/proc/filesystems") as f:
        overlay = any(line.split()[-1] == "overlay" for line in f if line.strip())
    release = os.uname().release
    return [
        Check("kernel checkpoint/restore", cr, f"{release}: CONFIG_CHECKPOINT_RESTORE "
              f"{'present' if cr else 'missing'}", "use a kernel built with CONFIG_CHECKPOINT_RESTORE=y"),
        Check("kernel overlayfs", overlay, "overlay in /proc/filesystems" if overlay else "overlay missing",
              "modprobe overlay (or use a kernel with CONFIG_OVERLAY_FS)"),
        _check_pidfd(),
    ]


def _check_pidfd() -> Check:
    """``EnvConfig(recover_while_idle=True)`` learns of a sandbox's death through a pidfd."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        ok, detail = True, "pidfd_open works: recover_while_idle can watch sandboxes"
    except (AttributeError, OSError) as e:
        ok, detail = False, f"no pidfd_open ({e}): recover_while_idle finds deaths at the next step instead"
    return Check("pidfd death watch", ok, detail, "use Linux >= 5.3 and Python >= 3.9", required=False)


def check_disk_cap() -> Check:
    """The default sandbox disk cap (``SandboxConfig.disk``) loop-mounts an ext4 per sandbox."""
    missing = [] if shutil.which("mkfs.ext4") else ["mkfs.ext4"]
    if os.geteuid() != 0:
        missing.append("root")
    if not os.path.exists(mounting.LOOP_CONTROL):
        missing.append(f"loop devices ({mounting.LOOP_CONTROL})")
    return Check("sandbox disk cap", not missing, "mkfs.ext4, loop devices, root" if not missing
                 else f"missing: {', '.join(missing)}",
                 "apt-get install e2fsprogs; modprobe loop; run as root — or create sandboxes with disk=None")


def check_scratch() -> Check:
    """Where a capture's frozen part writes: the default scratch root, a large-folio tmpfs
    when it can be one (``checkpoint.scratch``: a heavy sandbox's memory dump 2x faster)."""
    from belayer_env.store import in_memory, scratch
    from belayer_env.store.store import DEFAULT_SCRATCH

    if DEFAULT_SCRATCH is None:
        return Check("capture scratch", False, "no /dev/shm: captures write under the store",
                     "mount a tmpfs at /dev/shm", required=False)
    root = DEFAULT_SCRATCH / "belayer-scratch"
    options = scratch.mount_options(root)
    if options is not None:
        return Check("capture scratch", True, f"{root}: tmpfs {options}", "", required=False)
    busy = root.is_dir() and any(root.iterdir())
    why = ("transparent huge pages for shmem unavailable" if not in_memory.huge_supported() else
           "not root" if os.geteuid() != 0 else
           "it holds captures' scratch: mounted once empty, `belayer gc` removes dead ones" if busy else
           "not mounted yet: the first checkpoint store mounts it")
    return Check("capture scratch", False, f"{root}: a plain directory of /dev/shm ({why})",
                 "a kernel with CONFIG_TRANSPARENT_HUGEPAGE and root, or nothing: captures work, "
                 "a large memory dump is slower", required=False)


def check_conntrack() -> Check:
    """CRIU walks the host's whole conntrack table twice inside every capture's freeze
    (``belayer_env.host.conntrack``): set-up keeps it small."""
    from belayer_env.host import conntrack

    n = conntrack.buckets()
    if n is None:
        return Check("conntrack table", True, "no conntrack in this kernel: nothing to walk", "", required=False)
    try:
        walk = f"one walk {conntrack.walk_s() * 1e3:.1f} ms, two per checkpoint"
    except OSError as e:
        walk = f"walk not timed: {e}"
    return Check("conntrack table", n <= conntrack.TARGET_BUCKETS, f"{n} buckets ({walk})",
                 f"run `{SETUP}` (lowers it to {conntrack.TARGET_BUCKETS}; {conntrack.ENV}=keep leaves it)",
                 required=False)


def check_netns_hash() -> Check:
    """CRIU walks a sandbox namespace's TCP and UDP tables inside every capture's freeze
    (``belayer_env.host.netns_hash``): set-up gives new namespaces small ones of their own."""
    from belayer_env.host import netns_hash

    sizes = netns_hash.sizes()
    if not sizes:
        return Check("namespace socket tables", True, "this kernel has none of its own per namespace (Linux < 6.2)",
                     "", required=False)
    return Check("namespace socket tables", netns_hash.ok(sizes), f"new namespaces: {netns_hash.describe(sizes)}",
                 f"run `{SETUP}` (sets {netns_hash.TARGET_ENTRIES}; {netns_hash.ENV}=keep leaves it); sandboxes "
                 "created before keep the host's tables", required=False)


def check_fast_tar() -> Check:
    """CRIU dumps each tmpfs of a sandbox with ``tar`` inside the freeze: set-up builds the
    in-process one (``belayer_env.host.fast_tar``), checked here against the host's tar."""
    from belayer_env.criu import runtime
    from belayer_env.host import fast_tar

    fix = f"run `{SETUP}` (builds it; needs gcc and zlib1g-dev)"
    if not fast_tar.installed():
        return Check("criu tmpfs tar", False, f"{fast_tar.HELPER} not installed: each checkpoint's freeze runs "
                     "GNU tar + gzip per tmpfs (~25 ms more here)", fix, required=False)
    try:
        why = fast_tar.check()
    except (fast_tar.BuildError, OSError) as e:
        why = str(e)
    if why:
        return Check("criu tmpfs tar", False, f"{fast_tar.HELPER}: {why}", fix, required=False)
    used = "every dump" if runtime.FAST_TAR else "no dump (BELAYER_CRIU_FAST_TAR=0)"
    restores = fast_tar.dockerd_uses_it()
    if restores is False:
        return Check("criu tmpfs tar", False, f"{fast_tar.HELPER}: used by {used}; restores run GNU tar + gzip per tmpfs "
                     f"(~25 ms more each): dockerd's PATH does not start with {fast_tar.DIR}",
                     f"run `{SETUP}` (restarts a dockerd that holds no container with it), or start dockerd "
                     f"with PATH={fast_tar.DIR}:$PATH", required=False)
    where = ("and every restore" if not fast_tar.RESTORE_OFF.exists() else f"(restores: off, {fast_tar.RESTORE_OFF})"
             ) if restores else "(restores: no local dockerd to check)"
    return Check("criu tmpfs tar", True, f"{fast_tar.HELPER}: GNU tar's archives, in-process; used by {used} {where}",
                 "", required=False)


def check_engine() -> list[Check]:
    missing = [m for m in ("torch", "aiohttp", "safetensors") if importlib.util.find_spec(m) is None]
    return [Check("engine packages", not missing, "torch, aiohttp, safetensors importable" if not missing
                  else f"missing: {', '.join(missing)}", "pip install 'belayer[engine]' "
                  "(torch==2.13.0 first on CPU machines)", required=False)]


def run_checks() -> list[Check]:
    return [*check_docker(), *check_criu(), check_ctrd_copies(), *check_kernel(), check_disk_cap(), check_scratch(),
            check_conntrack(), check_netns_hash(), check_fast_tar(), *check_engine()]
