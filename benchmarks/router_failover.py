"""Belayer's router beside sglang-router, in front of two real SGLang servers, one SIGKILLed
mid-stream (issue 49, item 3).

Two CPU SGLang servers (the SGLang venv, the embedded model, greedy) behind each router in
turn: sglang-router 0.3.2 (``python -m sglang_router.launch_router --worker-urls A B``, its
defaults: cache-aware policy, retries, circuit breaker) and Belayer's
``python3 -m belayer serve router --worker A --worker B``. Per router: ``--requests`` streamed
native ``/generate`` requests at once, first fault-free, then again while server A is
SIGKILLed (its whole process group) as soon as any stream has ``--kill-at`` ids; then
``--next-requests`` more requests, one after the other, with A still dead. Server A is
started again before the next router. Measured per router: requests completed (all
``--max-new-tokens`` ids and a ``length`` finish), tokens lost and duplicated against the
fault-free run of the same router (difflib's matching blocks: ids of the fault-free run the
client never got, ids it got that are not in it), errors the client saw (HTTP status, SSE
error events, streams ended early without one), the time from the kill to each stream's next
id, and what the next requests got.

    python3 benchmarks/router_failover.py            # ~6 min on 2 cores; --help

writes ``benchmarks/results/router_failover.{json,png}``. sglang-router's launcher imports
SGLang, which on this CPU machine needs the project's stand-ins on its PYTHONPATH (as the
SGLang servers get them, ``launcher.server_env``); ``scripts/setup_sglang_router.sh`` installs it.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from belayer_engine.backends.sglang.launcher import (  # noqa: E402
    SGLangServerConfig,
    server_argv,
    server_env,
    venv_python,
)
from belayer_engine.backends.sglang.model_dir import ensure_embedded_model  # noqa: E402
from belayer_engine.common.net import free_port  # noqa: E402
from benchmarks._plotting import pyplot, save_result  # noqa: E402

START_S = 600.0


def get(url: str, path: str, timeout: float = 5.0) -> int:
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except OSError:
        return 0
    finally:
        conn.close()


def wait_healthy(url: str, proc: subprocess.Popen, what: str, path: str = "/health") -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_S:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before answering {path}")
        if get(url, path) == 200:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise SystemExit(f"{what} did not answer {path} within {START_S:.0f} s")


def wait_for(predicate, what: str) -> None:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > START_S:
            raise SystemExit(f"{what}: not ready within {START_S:.0f} s")
        time.sleep(0.2)


def activated(log: Path) -> int:
    """Workers sglang-router says it activated ("Activated 1 worker(s) (marked as healthy)")."""
    return log.read_text(errors="replace").count("Activated 1 worker(s)")


class Process:
    """A child in its own process group, its output in a log file; ``kill`` is a SIGKILL of the group."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path):
        self.log = open(log, "ab")  # noqa: SIM115 - closed in kill()
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.log.close()


def start_server(port: int, model: str, logs: Path, name: str) -> tuple[Process, str]:
    cfg = SGLangServerConfig(model_path=model, port=port)
    server = Process(server_argv(cfg), server_env(cfg), logs / f"sglang-{name}.log")
    return server, f"http://127.0.0.1:{port}"


def start_router(kind: str, workers: list[str], logs: Path) -> tuple[Process, str]:
    port = free_port()
    if kind == "sglang-router":
        env = server_env(SGLangServerConfig(model_path="unused", port=port))  # the CPU stand-ins, SGLang's venv only
        argv = [str(venv_python()), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--worker-urls", *workers]
    else:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        argv = [sys.executable, "-m", "belayer", "serve", "router", "--port", str(port)]
        for w in workers:
            argv += ["--worker", w]
    return Process(argv, env, logs / f"router-{kind}.log"), f"http://127.0.0.1:{port}"


class Stream:
    """One streamed native ``/generate``: every id with its arrival time, and how it ended."""

    def __init__(self, base: str, prompt: list[int], max_new: int):
        self.base, self.prompt, self.max_new = base, prompt, max_new
        self.ids: list[int] = []
        self.times: list[float] = []
        self.finish: str | None = None
        self.errors: list[str] = []
        self.done_marker = False
        self.cut_silently = False  # the stream ended with no finish reason, no [DONE] and no error
        self.recoveries = 0

    def run(self) -> None:
        body = {"input_ids": self.prompt, "stream": True,
                "sampling_params": {"max_new_tokens": self.max_new, "temperature": 0.0, "ignore_eos": True}}
        u = urlsplit(self.base)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
        try:
            conn.request("POST", "/generate", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self.errors.append(f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:200]}")
                return
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done_marker = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors.append(f"SSE error: {json.dumps(chunk['error'])[:200]}")
                    continue
                self._take(chunk)
        except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
            self.errors.append(f"{type(e).__name__}: {e}"[:200])
        finally:
            conn.close()
        self.cut_silently = not self.errors and (self.finish is None or not self.done_marker)

    def _take(self, chunk: dict) -> None:
        ids = chunk.get("output_ids") or []
        new = ids[len(self.ids):] if ids[: len(self.ids)] == self.ids else ids  # cumulative or incremental
        now = time.monotonic()
        self.ids += new
        self.times += [now] * len(new)
        meta = chunk.get("meta_info") or {}
        if meta.get("finish_reason"):
            self.finish = meta["finish_reason"].get("type")
        self.recoveries = int((meta.get("belayer") or {}).get("recoveries", self.recoveries))


def prompts(n: int) -> list[list[int]]:
    return [list(f"Request {i}: tell a long story about routers.".encode()) for i in range(n)]


def run_streams(base: str, n: int, max_new: int, on_progress=None) -> list[Stream]:
    streams = [Stream(base, p, max_new) for p in prompts(n)]
    threads = [threading.Thread(target=s.run, daemon=True) for s in streams]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if on_progress is not None:
            on_progress(streams)
        time.sleep(0.002)
    return streams


def compare(got: list[int], want: list[int]) -> tuple[int, int]:
    """(lost, duplicated): ids of ``want`` the client never got, ids it got that are not in ``want``."""
    matched = sum(b.size for b in difflib.SequenceMatcher(a=got, b=want, autojunk=False).get_matching_blocks())
    return len(want) - matched, len(got) - matched


def measure(kind: str, servers: dict[str, Process], urls: list[str], args, logs: Path) -> dict:
    router, base = start_router(kind, urls, logs)
    try:
        wait_healthy(base, router.proc, kind)
        if kind == "sglang-router":  # its /health answers 200 before it has registered any worker
            wait_for(lambda: activated(logs / f"router-{kind}.log") >= len(urls), "sglang-router's workers")
        reference = run_streams(base, args.requests, args.max_new_tokens)
        killed: dict = {}

        def kill_when_due(streams: list[Stream]) -> None:
            if not killed and max(len(s.ids) for s in streams) >= args.kill_at:
                killed["at_ids"] = [len(s.ids) for s in streams]
                killed["time"] = time.monotonic()
                servers["A"].kill()

        faulted = run_streams(base, args.requests, args.max_new_tokens, kill_when_due)
        rows = []
        for ref, s in zip(reference, faulted, strict=True):
            lost, dup = compare(s.ids, ref.ids)
            after = [t for t in s.times if t > killed.get("time", float("inf"))]
            rows.append({"ids": len(s.ids), "ids_at_kill": killed["at_ids"][len(rows)] if killed else None,
                         "finish": s.finish, "errors": s.errors, "cut_silently": s.cut_silently,
                         "done_marker": s.done_marker, "lost": lost, "duplicated": dup,
                         "equal_to_fault_free": s.ids == ref.ids, "recoveries": s.recoveries,
                         "next_id_after_kill_s": round(after[0] - killed["time"], 4) if after else None,
                         "completed": s.finish == "length" and len(s.ids) == args.max_new_tokens and not s.errors})
        nxt = []
        for _ in range(args.next_requests):
            one = run_streams(base, 1, args.max_new_tokens)[0]
            nxt.append({"ids": len(one.ids), "finish": one.finish, "errors": one.errors, "cut_silently": one.cut_silently,
                        "completed": one.finish == "length" and len(one.ids) == args.max_new_tokens and not one.errors})
        reference_ok = all(s.finish == "length" and len(s.ids) == args.max_new_tokens and not s.errors
                           for s in reference)
        return {"router": kind, "fault_free_all_completed": reference_ok, "requests": rows,
                "completed": sum(r["completed"] for r in rows), "lost": sum(r["lost"] for r in rows),
                "duplicated": sum(r["duplicated"] for r in rows),
                "client_errors": sum(len(r["errors"]) for r in rows),
                "truncated_without_error": sum(1 for r in rows if not r["errors"] and not r["completed"]),
                "cut_silently": sum(r["cut_silently"] for r in rows),
                "next_id_after_kill_s": sorted(r["next_id_after_kill_s"] for r in rows
                                               if r["next_id_after_kill_s"] is not None),
                "next_requests": nxt, "next_requests_completed": sum(r["completed"] for r in nxt),
                "killed_at_ids": killed.get("at_ids")}
    finally:
        router.kill()


def plot(result: dict, png: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = result["routers"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    keys = [("completed", "streams completed"), ("client_errors", "errors seen"),
            ("truncated_without_error", "cut short, no error"), ("next_requests_completed", "next requests ok")]
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        ax1.bar([k + i * width for k in range(len(keys))], [run[k] for k, _ in keys], width, label=run["router"])
    ax1.set_xticks([k + width * (len(runs) - 1) / 2 for k in range(len(keys))], [t for _, t in keys], fontsize=8)
    ax1.set_title(f"{result['config']['requests']} streams, server A SIGKILLed at {result['config']['kill_at']} ids "
                  f"({result['config']['next_requests']} next requests)", fontsize=9)
    ax1.legend(fontsize=8)
    for run in runs:
        times = run["next_id_after_kill_s"]
        ax2.plot(range(1, len(times) + 1), times, "o-", label=f"{run['router']} (lost {run['lost']}, dup "
                 f"{run['duplicated']})")
    ax2.set_xlabel("streams that got an id after the kill (sorted)")
    ax2.set_ylabel("kill -> next id (s)")
    ax2.set_title("time to the next token", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=8, help="streamed requests at once, per run")
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument("--kill-at", type=int, default=32, help="SIGKILL server A once a stream has this many ids")
    p.add_argument("--next-requests", type=int, default=6, help="requests sent one by one after the faulted run")
    p.add_argument("--routers", nargs="+", default=["sglang-router", "belayer"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_failover.json"))
    args = p.parse_args()
    model = str(ensure_embedded_model())
    logs = Path(tempfile.mkdtemp(prefix="belayer-router-failover-"))
    print(f"logs in {logs}", flush=True)
    ports = {"A": free_port(), "B": free_port()}
    servers, urls = {}, {}
    for name in ("A", "B"):
        servers[name], urls[name] = start_server(ports[name], model, logs, name)
    runs = []
    try:
        for name in ("A", "B"):
            print(f"SGLang server {name} up in {wait_healthy(urls[name], servers[name].proc, name):.0f} s", flush=True)
        for i, kind in enumerate(args.routers):
            if i:  # A was killed by the previous run (if its kill fired): a fresh one on the same port
                servers["A"].kill()
                servers["A"], _ = start_server(ports["A"], model, logs, "A")
                wait_healthy(urls["A"], servers["A"].proc, "A (restarted)")
            run = measure(kind, servers, [urls["A"], urls["B"]], args, logs)
            runs.append(run)
            print(json.dumps({k: v for k, v in run.items() if k not in ("requests", "next_requests")}), flush=True)
    finally:
        for s in servers.values():
            with contextlib.suppress(Exception):
                s.kill()
    result = {"config": vars(args) | {"model": model, "servers": "SGLang 0.5.23, CPU, 1 thread each"},
              "routers": runs, "date": time.strftime("%Y-%m-%d %H:%M"), "load_at_end": os.getloadavg()[0]}
    print(save_result(result, args.out, plot))


if __name__ == "__main__":
    main()
