"""``benchmarks/_thread_states.py``: a sampler in another process places a GIL-holding stall of
a Python process and says which thread ran (on a CPU) and which waited for the GIL (futex),
on the monotonic clock the benchmark's kill is timed on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[4] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import _thread_states as states  # noqa: E402

# A main thread that holds the GIL in C (filling a fresh 400 MB buffer: ~0.2 s on the CI VM)
# while another thread wakes every ms and must wait for the GIL.
TARGET = """
import threading, time
def tick():
    while True:
        time.sleep(0.001)
threading.Thread(target=tick, daemon=True).start()
print("ready", flush=True)
input()
t0 = time.monotonic(); buf = b"x" * 400_000_000; t1 = time.monotonic()
print(t0, t1, flush=True)
input()
"""


def test_a_gil_held_stall_is_placed_and_its_threads_told_apart(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        out = tmp_path / "states.json"
        sampler = subprocess.Popen([sys.executable, str(BENCHMARKS / "_thread_states.py"), "--pid", str(target.pid),
                                    "--seconds", "60", "--out", str(out)], stdout=subprocess.PIPE, text=True)
        assert sampler.stdout.readline().strip() == "sampling"
        target.stdin.write("\n")
        target.stdin.flush()
        t0, t1 = (float(v) for v in target.stdout.readline().split())
        target.stdin.write("\n")
        target.stdin.flush()
        target.wait(timeout=60)
        sampler.wait(timeout=120)  # ends early: the process is gone
    finally:
        target.kill()
    data = json.loads(out.read_text())
    inside = [i for i, t in enumerate(data["t"]) if t0 + 0.2 * (t1 - t0) <= t <= t1]
    assert len(inside) >= 20, f"the sampler ran through the stall ({len(inside)} samples in {1e3 * (t1 - t0):.0f} ms)"
    main, other = data["threads"][str(target.pid)], next(v for k, v in data["threads"].items() if k != str(target.pid))
    main_states = [s[1] for s in main["samples"] if s[0] in set(inside)]
    waits = [s[3] for s in other["samples"] if s[0] in set(inside) and s[1] != "R"]
    assert main_states.count("R") >= 0.8 * len(main_states), main_states
    assert waits and waits.count("futex") >= 0.8 * len(waits), f"the ticker waits for the GIL: {waits}"
    text = states.summary(data, t0 - 0.01, t1 + 0.01)
    assert f"== thread {target.pid} (python" in text and ", main)" in text
    assert "R running" in text and "futex" in text
    kept = states.window(data, t0, t1)
    assert kept["t"] == [t for t in data["t"] if t0 <= t <= t1]
    assert all(s[0] < len(kept["t"]) for th in kept["threads"].values() for s in th["samples"])


def test_bad_arguments_are_refused_with_the_reason(tmp_path):
    run = [sys.executable, str(BENCHMARKS / "_thread_states.py")]
    for args, said in ((["--pid", "1"], "--pid and --out"), (["--pid", "999999999", "--out", str(tmp_path / "x")],
                                                            "no process 999999999"),
                       (["--pid", "1", "--out", str(tmp_path / "x"), "--seconds", "0"], "must be positive"),
                       (["--summary", str(tmp_path / "none.json")], "not a samples file"),
                       (["--summary", __file__], "not a samples file")):
        done = subprocess.run(run + args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and said in done.stderr, done.stderr
