"""The scripted workload of the consistency harness and the probe of its final state.

Eight actions with persistent side effects of every kind the design cares about: edits,
deletes, renames, appends, a symlink, mode changes, a background TCP server holding an
in-memory counter, and a sqlite database. Every action appends its own line to a log,
increments the server's counter once and inserts its own row, so "each effect exactly
once" is checkable, and sleeps briefly between effects so a fault can land mid-action
(leaving a partial effect the recovery must discard).
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from belayer_env.sandbox.protocol import Sandbox
from belayer_env.sandbox.treehash import tree_hash

PORT = 7000
SERVER = f"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", {PORT})); s.listen(8)
n = 0
while True:
    c, _ = s.accept()
    f = c.makefile("rw")
    if f.readline().strip() == "inc":
        n += 1
    f.write(str(n) + "\\n"); f.flush(); c.close()
"""
SETUP = f"mkdir -p /work && cat > /opt/counter.py <<'EOF'\n{SERVER}\nEOF"

_TALK = "talk() {{ exec 3<>/dev/tcp/127.0.0.1/{port}; echo \"$1\" >&3; read -r reply <&3; exec 3>&-; echo \"$reply\"; }}"
_PRELUDE = "set -e; cd /work; " + _TALK.format(port=PORT) + "\n"


def _sql(statement: str) -> str:
    code = f"import sqlite3; db = sqlite3.connect('/work/app.db'); db.execute({statement!r}); db.commit()"
    return f"python3 -c {shlex.quote(code)}"


def _common(i: int) -> str:
    """Effects every action has once: log append, counter increment, db row."""
    return (f"echo 'step {i}' >> log.txt\nsleep 0.05\n"
            f"echo \"$(talk inc)\" >> counter_seen.txt\n"
            f"{_sql(f'insert into steps(step) values ({i})')}\n")


_EFFECTS = [
    # 1: a background server with in-memory state, files, the database
    "setsid nohup python3 /opt/counter.py >/dev/null 2>&1 </dev/null &\n"
    "for t in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/7000) 2>/dev/null && break; sleep 0.05; done\n"
    "mkdir -p src docs && printf 'def a():\\n    return 1\\n' > src/a.py && echo 'b = 2' > src/b.py\n"
    "echo notes > docs/x.md\n" + _sql("create table steps(id integer primary key, step int)"),
    # 2: edit in place
    "sed -i 's/return 1/return 42/' src/a.py\nsleep 0.05\necho '# edited' >> src/a.py",
    # 3: delete + rename
    "rm src/b.py\nsleep 0.05\nmv docs/x.md docs/y.md",
    # 4: append, chmod, symlink
    "printf 'def c():\\n    return 3\\n' >> src/a.py\nchmod 750 src/a.py\nln -s src/a.py link.py",
    # 5: a deeper tree and a bigger file
    "mkdir -p deep/a/b\nyes belayer | head -c 300000 > deep/a/b/big.txt\nsleep 0.05\necho small > deep/a/s.txt",
    # 6: remove a directory, rename another
    "rm -rf docs\nsleep 0.05\nmv deep deeper",
    # 7: truncate and rewrite
    ": > deeper/a/s.txt\necho rewritten >> deeper/a/s.txt\ntruncate -s 1000 deeper/a/b/big.txt",
    # 8: summary written from the current state
    "ls -R > listing.txt\nwc -l log.txt > summary.txt",
]
ACTIONS = [_PRELUDE + effect + "\n" + _common(i + 1) for i, effect in enumerate(_EFFECTS)]
N_STEPS = len(ACTIONS)

_PROBE = _PRELUDE + (
    "echo \"counter=$(talk get)\"\n"
    "python3 -c \"import sqlite3; print('rows=' + repr(sqlite3.connect('/work/app.db').execute("
    "'select id, step from steps order by id').fetchall()))\"\n"
    "echo \"log=$(tr '\\n' '|' < log.txt)\"\necho \"seen=$(tr '\\n' '|' < counter_seen.txt)\"\n"
)


def probe(sandbox: Sandbox) -> dict[str, Any]:
    """The state the trial is judged on: runtime (server counter), db, logs, whole-FS hash."""
    result = sandbox.execute(_PROBE, timeout=30)
    state: dict[str, Any] = {"probe_returncode": result["returncode"]}
    for line in result["output"].splitlines():
        key, sep, value = line.partition("=")
        if sep:
            state[key] = value
    state["tree"] = tree_hash(sandbox, "/")
    return state


def exactly_once_violations(state: dict[str, Any]) -> list[str]:
    """Named violations of "every action's effect applied exactly once" (empty: none)."""
    want_log = "|".join(f"step {i}" for i in range(1, N_STEPS + 1)) + "|"
    want_seen = "|".join(str(i) for i in range(1, N_STEPS + 1)) + "|"
    want_rows = repr([(i, i) for i in range(1, N_STEPS + 1)])
    problems = []
    if state.get("counter") != str(N_STEPS):
        problems.append(f"in-memory counter is {state.get('counter')!r}, want {N_STEPS}")
    if state.get("log") != want_log:
        problems.append(f"log is {state.get('log')!r}")
    if state.get("seen") != want_seen:
        problems.append(f"counter replies were {state.get('seen')!r}")
    if state.get("rows") != want_rows:
        problems.append(f"db rows are {state.get('rows')!r}")
    return problems


def describe(state: dict[str, Any]) -> str:
    return json.dumps(state, sort_keys=True)
