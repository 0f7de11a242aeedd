# Shell helpers shared by the set-up scripts (sourced, not run): step/info/die for output,
# run_logged for long commands. Sourcing it changes no shell options.

step() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
info() { printf '    %s\n' "$*"; }
die() { printf '\033[31merror:\033[0m %s\n' "$*" >&2; exit 1; }
# run a long command with its log in a file, printing a dot every 5 s as progress; on
# failure print the log's tail and stop
run_logged() {
  local log=$1; shift
  ( "$@" >"$log" 2>&1 ) & local pid=$!
  local t=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1; t=$((t + 1)); (( t % 5 == 0 )) && printf '.' || true
  done
  if ! wait "$pid"; then
    printf '\n'; tail -n 40 "$log" >&2; die "step failed; full log: $log"
  fi
  (( t >= 5 )) && printf ' %ds\n' "$t" || true
}
# name==version of every distribution the project's python ($PY) sees, one a line, the
# project itself and the names given as arguments left out: pip's constraints that hold the
# project's packages where they are while a test dependency is added beside them
project_constraints() {
  SKIP="belayer $*" "$PY" - <<'PYEOF'
import importlib.metadata as md
import os
skip = set(os.environ["SKIP"].split())
seen = {}
for dist in md.distributions():
    name = (dist.metadata["Name"] or "").strip()
    key = name.lower().replace("_", "-").replace(".", "-")
    if name and key not in seen and key not in skip:
        seen[key] = f"{name}=={dist.version}"
print("\n".join(sorted(seen.values(), key=str.lower)))
PYEOF
}
# a venv at $1 that sees the project's packages ($PY's site) and has no pip of its own (the
# project's pip installs into it); returns 0 at once when its stamp file $2 already says $3
side_venv_ready() {
  local venv=$1 stamp=$2 text=$3
  [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$text" ] && [ -x "$venv/bin/python" ] && return 0
  [ -x "$venv/bin/python" ] || "$PY" -m venv --system-site-packages --without-pip "$venv"
  return 1
}
