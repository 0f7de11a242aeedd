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
