#!/usr/bin/env bash
# Belayer set-up for a fresh Debian 12/13 machine, run as root. Idempotent: every step
# checks first and skips what is already in place, so a re-run on a ready machine takes
# seconds. Steps: Docker engine (experimental on) -> CRIU >= 4.2 (+ pycriu) -> base image
# -> the Python package. Environment knobs:
#   BELAYER_PYTHON       python used for the package (default: python3)
#   BELAYER_BASE_IMAGE   base image tag (default: belayer-base:latest)
#   BELAYER_SKIP_PIP=1   skip installing the Python package
#   BELAYER_SKIP_SGLANG=1  skip SGLang's venv (scripts/setup_sglang.sh; the SGLang tests then fail)
#   BELAYER_CONNTRACK_BUCKETS  conntrack buckets to lower the host's table to (default 16384), or
#                        `keep` (belayer_env/host/conntrack.py: what it costs and saves)
#   BELAYER_NETNS_HASH   TCP/UDP table size for new network namespaces (default 1024), or `keep`
#                        (belayer_env/host/netns_hash.py: what it costs and saves)
set -euo pipefail

PY=${BELAYER_PYTHON:-python3}
IMAGE=${BELAYER_BASE_IMAGE:-belayer-base:latest}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CRIU_SRC_DIR=/usr/local/src/belayer-criu
LOG_DIR=/var/log/belayer
mkdir -p "$LOG_DIR"

# step/info/die, run_logged
. "$ROOT/scripts/lib.sh"

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts dockerd)"
[ -f /etc/debian_version ] || die "this script supports Debian 12/13 only"
. /etc/os-release
CODENAME=${VERSION_CODENAME:-bookworm}

APT_UPDATED=0
apt_update() {
  if [ "$APT_UPDATED" = 0 ]; then
    run_logged "$LOG_DIR/apt-update.log" apt-get update
    APT_UPDATED=1
  fi
}
apt_install() {
  local missing=()
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
  [ ${#missing[@]} = 0 ] && return 0
  apt_update
  info "apt-get install ${missing[*]}"
  run_logged "$LOG_DIR/apt-install.log" env DEBIAN_FRONTEND=noninteractive apt-get install -y \
    --no-install-recommends -o APT::Get::Upgrade-By-Source-Package=false "${missing[@]}"
}

# ---------------------------------------------------------------- Docker engine
step "Docker engine"
docker_ok() { timeout 10 docker info >/dev/null 2>&1; }
# CRIU's restores (run by dockerd -> containerd -> runc) find their tmpfs tar through dockerd's
# PATH: ours first (belayer_env/host/fast_tar.py, built below; until then, or if it is not
# installed, tar is GNU tar as before)
FAST_TAR_DIR=/usr/local/libexec/belayer-criu-tar
dockerd_path_ok() {
  local pid; pid=$(pgrep -xo dockerd) || return 1
  tr '\0' '\n' <"/proc/$pid/environ" | grep -q "^PATH=$FAST_TAR_DIR:"
}
# a dockerd we may restart for that alone: not systemd's, and holding no container
dockerd_restartable() {
  ! { command -v systemctl >/dev/null && systemctl is-active --quiet docker 2>/dev/null; } &&
    [ -z "$(timeout 10 docker ps -aq 2>/dev/null)" ]
}
if docker_ok && [ "$(docker info --format '{{.ExperimentalBuild}}' 2>/dev/null)" = true ] &&
   { dockerd_path_ok || ! dockerd_restartable; }; then
  info "dockerd answers, experimental on"
  dockerd_path_ok || info "its PATH lacks $FAST_TAR_DIR (it holds containers or is systemd's): restores run GNU tar"
else
  command -v dockerd >/dev/null || apt_install docker.io
  mkdir -p /etc/docker
  if [ ! -s /etc/docker/daemon.json ]; then
    echo '{"experimental": true}' >/etc/docker/daemon.json
  elif ! grep -q '"experimental": *true' /etc/docker/daemon.json; then
    "$PY" - <<'PYEOF'
import json, pathlib
p = pathlib.Path("/etc/docker/daemon.json")
cfg = json.loads(p.read_text() or "{}")
cfg["experimental"] = True
p.write_text(json.dumps(cfg, indent=2))
PYEOF
  fi
  if docker_ok; then
    info "dockerd runs without experimental or without $FAST_TAR_DIR in its PATH: restarting it"
    pkill -x dockerd || true
    for _ in $(seq 60); do pgrep -x dockerd >/dev/null || break; sleep 0.5; done
  fi
  # a dockerd killed with a previous session may still be dying, or have left its pid file
  if pgrep -x dockerd >/dev/null; then
    info "a dockerd process runs but does not answer: stopping it"
    pkill -x dockerd || true
    for _ in $(seq 40); do pgrep -x dockerd >/dev/null || break; sleep 0.5; done
    pkill -9 -x dockerd 2>/dev/null || true
    for _ in $(seq 40); do pgrep -x dockerd >/dev/null || break; sleep 0.5; done
  fi
  pgrep -x dockerd >/dev/null && die "an old dockerd does not exit; stop it and re-run"
  rm -f /var/run/docker.pid
  info "starting dockerd (log: $LOG_DIR/dockerd.log)"
  setsid nohup env PATH="$FAST_TAR_DIR:$PATH" dockerd >"$LOG_DIR/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 120); do docker_ok && break; sleep 0.5; done
  docker_ok || { tail -n 30 "$LOG_DIR/dockerd.log" >&2; die "dockerd did not answer within 60 s"; }
  info "dockerd up: $(docker info --format 'server {{.ServerVersion}}, storage {{.Driver}}, experimental {{.ExperimentalBuild}}')"
fi

# ---------------------------------------------------------------- CRIU >= 4.2
step "CRIU >= 4.2"
criu_version_ok() {
  local v; v=$(criu --version 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$v" ] || return 1
  "$PY" -c "import sys; v=tuple(int(x) for x in '$v'.split('.')[:2]); sys.exit(0 if v >= (4, 2) else 1)"
}
# CRIU caches its kernel probing (~30 ms of every dump and restore, more under load) in
# $KDAT_DIR/criu.kdat, but only on a tmpfs (the cache must not outlive a reboot); /run is
# not always one, so CRIU is built to keep it in $KDAT_DIR, a tmpfs mounted below.
KDAT_DIR=/run/criu
criu_kdat_ok() { grep -qa "$KDAT_DIR/criu.kdat" "$(command -v criu)"; }
if criu_version_ok && criu_kdat_ok && criu check >/dev/null 2>&1; then
  info "$(command -v criu): $(criu --version | head -1), criu check passes"
else
  apt_install build-essential pkgconf libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev \
    protobuf-compiler libnl-3-dev libnet1-dev libbsd-dev libnftables-dev libgnutls28-dev \
    uuid-dev python3-protobuf iptables xz-utils libcap-dev dpkg-dev
  # sid *source* only: binaries stay from the host release (libc6 is never upgraded).
  SRC_LIST=/etc/apt/sources.list.d/belayer-sid-src.sources
  if [ ! -f "$SRC_LIST" ]; then
    printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: sid\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' >"$SRC_LIST"
    APT_UPDATED=0
  fi
  apt_update
  mkdir -p "$CRIU_SRC_DIR" && cd "$CRIU_SRC_DIR"
  if ! ls criu_*.orig.tar.* >/dev/null 2>&1; then
    info "downloading criu source (sid)"
    apt-get source --download-only criu/sid >"$LOG_DIR/criu-source.log" 2>&1 || true
    ls criu_*.orig.tar.* >/dev/null 2>&1 || { tail "$LOG_DIR/criu-source.log" >&2; die "could not download criu's source from sid"; }
  fi
  tarball=$(ls criu_*.orig.tar.* | sort -V | tail -1)
  srcdir=$( (tar -tf "$tarball" || true) | head -1 | cut -d/ -f1)
  [ -d "$srcdir" ] || tar -xf "$tarball"
  ln -sfn "$CRIU_SRC_DIR/$srcdir" "$CRIU_SRC_DIR/current"
  info "building $srcdir (make criu lib; ~30 s on 2 cores)"
  rm -f "$srcdir/criu/kerndat.o"  # KDAT_DIR is compiled into it
  run_logged "$LOG_DIR/criu-build.log" make -C "$srcdir" -j"$(nproc)" criu lib RUNDIR="$KDAT_DIR"
  run_logged "$LOG_DIR/criu-install.log" make -C "$srcdir" install-criu PREFIX=/usr/local RUNDIR="$KDAT_DIR"
  hash -r
  criu_version_ok || die "installed criu is not >= 4.2: $(criu --version 2>&1 | head -1)"
  criu_kdat_ok || die "installed criu does not keep its kernel-probe cache in $KDAT_DIR"
  criu check || die "criu check failed; see 'criu check --all'"
  info "installed $(criu --version | head -1) at $(command -v criu)"
  cd "$ROOT"
fi
mkdir -p /etc/criu
# runc reads this when docker checkpoints: keep established TCP and file locks.
[ -f /etc/criu/runc.conf ] || printf 'tcp-established\nfile-locks\n' >/etc/criu/runc.conf
mkdir -p "$KDAT_DIR"
mountpoint -q "$KDAT_DIR" || mount -t tmpfs -o size=1m,mode=0755 belayer-criu-kdat "$KDAT_DIR" \
  || die "could not mount a tmpfs at $KDAT_DIR (CRIU's kernel-probe cache)"
info "CRIU's kernel-probe cache on tmpfs $KDAT_DIR"

step "pycriu for $PY"
if "$PY" -c "import pycriu" 2>/dev/null; then
  info "pycriu importable"
else
  [ -d "$CRIU_SRC_DIR/current/lib" ] || die "pycriu needs the criu source at $CRIU_SRC_DIR/current (remove criu and re-run to rebuild)"
  [ -f "$CRIU_SRC_DIR/current/lib/pycriu/images/magic.py" ] || run_logged "$LOG_DIR/criu-lib.log" make -C "$CRIU_SRC_DIR/current" lib
  run_logged "$LOG_DIR/pycriu.log" "$PY" -m pip install -q "protobuf>=3.20,<7" "$CRIU_SRC_DIR/current/lib"
  "$PY" -c "import pycriu" || die "pycriu did not import after install"
  info "pycriu installed"
fi

# ---------------------------------------------------------------- base image
step "Sandbox base image $IMAGE"
if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  info "present ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
else
  apt_install debootstrap
  ROOTFS=$(mktemp -d /var/tmp/belayer-rootfs.XXXXXX)
  info "debootstrap --variant=minbase $CODENAME (~40 s)"
  run_logged "$LOG_DIR/debootstrap.log" debootstrap --variant=minbase \
    --include=bash,coreutils,python3,git,procps "$CODENAME" "$ROOTFS" http://deb.debian.org/debian
  rm -rf "$ROOTFS"/usr/share/{doc,man,info,locale}/* "$ROOTFS"/var/cache/apt/* \
    "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/log/*.log
  info "docker import"
  tar -C "$ROOTFS" -c . | docker import \
    -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' -m "belayer sandbox base ($CODENAME minbase)" - "$IMAGE" >/dev/null
  rm -rf "$ROOTFS"
  info "built $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
fi

# ---------------------------------------------------------------- Python package
step "Python package (belayer)"
if [ "${BELAYER_SKIP_PIP:-0}" = 1 ]; then
  info "skipped (BELAYER_SKIP_PIP=1)"
else
  # CPU torch from the local wheel store when present; an unpinned torch would pull CUDA.
  if ! "$PY" -c "import torch" 2>/dev/null; then
    info "installing torch==2.13.0 (CPU build)"
    run_logged "$LOG_DIR/pip-torch.log" "$PY" -m pip install -q --progress-bar off torch==2.13.0
  fi
  # the editable install maps the top-level packages found at install time (setup.py says
  # which): re-install when they change
  stamp="$ROOT $(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/*/__init__.py 2>/dev/null | sha256sum | cut -c1-16) $(cd "$ROOT" && ls -d */__init__.py | tr "\n" " ") $("$PY" -c 'import sys; print(sys.executable)')"
  if [ "$(cat "$LOG_DIR/pip-stamp" 2>/dev/null)" = "$stamp" ] \
      && (cd / && "$PY" -c "import belayer.wrappers, belayer.examples, belayer_core, belayer_env, belayer_engine") 2>/dev/null; then
    info "belayer installed from $ROOT (pyproject unchanged)"
  else
    info "pip install -e $ROOT[all,dev,ray]"
    run_logged "$LOG_DIR/pip-belayer.log" "$PY" -m pip install -q --progress-bar off -e "$ROOT[all,dev,ray]"
    echo "$stamp" >"$LOG_DIR/pip-stamp"
  fi
fi

# ---------------------------- build tools for the static helpers CRIU runs (scripts/native/)
step "build tools (gcc, zlib, musl: the static CRIU helpers below)"
if command -v gcc >/dev/null && [ "$(gcc -print-file-name=libz.a)" != libz.a ] && [ -f /usr/include/zlib.h ] \
    && command -v musl-gcc >/dev/null; then
  info "gcc, zlib and musl present"
else
  apt_install build-essential zlib1g-dev musl-tools
fi

# ------------------------------------------- CRIU loopback hook (belayer_env/host/loopback.py)
step "CRIU loopback hook (sandboxes start without Docker's network stack)"
command -v ip >/dev/null || apt_install iproute2
command -v nsenter >/dev/null || apt_install util-linux
hook_out=$("$PY" "$ROOT/belayer_env/host/loopback.py") \
  || die "could not install the CRIU loopback hook"
info "$hook_out"

# --------------------------------- conntrack table (belayer_env/host/conntrack.py: frozen time)
step "conntrack table (CRIU walks all of it twice inside every checkpoint's freeze)"
ct_out=$("$PY" "$ROOT/belayer_env/host/conntrack.py") || die "could not size the conntrack table"
info "$ct_out"

# ------------------ socket tables of new namespaces (belayer_env/host/netns_hash.py: frozen time)
step "socket tables of new network namespaces (CRIU walks them inside every checkpoint's freeze)"
ns_out=$("$PY" "$ROOT/belayer_env/host/netns_hash.py") || die "could not size the namespaces' socket tables"
info "$ns_out"

# ------------------------- CRIU's tmpfs tar (belayer_env/host/fast_tar.py: frozen time)
step "CRIU's tmpfs tar (six tar + gzip runs inside every checkpoint's freeze and every restore, made in-process)"
tar_out=$("$PY" "$ROOT/belayer_env/host/fast_tar.py") || die "could not build CRIU's tmpfs tar"
info "$tar_out"

# ---------------------------------------------------------------- SGLang (its own venv)
if [ "${BELAYER_SKIP_SGLANG:-0}" = 1 ]; then
  step "SGLang"; info "skipped (BELAYER_SKIP_SGLANG=1)"
else
  bash "$ROOT/scripts/setup_sglang.sh"
  bash "$ROOT/scripts/setup_sglang_router.sh"   # benchmark dep: sglang-router beside `belayer serve router`
fi

bash "$ROOT/scripts/setup_skyrl.sh"         # test deps: skyrl-gym, then mini-swe-agent in its own venv
bash "$ROOT/scripts/setup_minisweagent.sh"
bash "$ROOT/scripts/setup_areal.sh"            # test dep: AReaL's SGLang client in its own venv
bash "$ROOT/scripts/setup_trl.sh"              # test dep: TRL in its own venv (belayer/examples/trl_grpo/)
bash "$ROOT/scripts/setup_verl.sh"             # test dep: verl's agent-loop path in its own venv (belayer/wrappers/verl/)

step "Ready"
command -v belayer >/dev/null && belayer doctor || true
