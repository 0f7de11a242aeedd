"""Scale benchmark: steps/s and memory vs the number of concurrent sandboxes, checkpoints on.

Runs ``belayer_env.ray.EpisodePool`` on a one-node Ray cluster on this machine (the node
declares ``{"belayer_sandbox": N}``), checkpoints replicated to a shared directory
(``file://``), policy ``always`` (a capture after every step whose predecessor is done: the
heaviest setting). Each of N concurrent episodes runs a repo-editing agent loop with a
fixed think time (the LLM's generation bubble, slept on the driver). Per size it reports:
aggregate committed steps/s (counted once all N episodes are reset), step latency, checkpoints replicated (count, bytes, upload
time), peak memory of the sandboxes (cgroup) and of the env actor processes, host CPU
load; and once, before the sizes, what one node loss costs (the episode's actor is
killed: time to continue from the replica, bytes fetched).

    python benchmarks/scale_bench.py                     # sizes 1 2 4 8 16
    python benchmarks/scale_bench.py --sizes 1 2 4       # a loaded machine: small sizes only
Writes benchmarks/results/scale_bench.json and scale_bench.png.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402

from belayer_env.env.recoverable import EnvConfig  # noqa: E402
from belayer_env.ray import SANDBOX_RESOURCE, EpisodePool, RayEnvConfig  # noqa: E402
from belayer_env.sandbox.config import SandboxConfig  # noqa: E402
from benchmarks._plotting import pyplot, save_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PREFIX = "belayer-scale"
SETUP = ("mkdir -p /repo && cd /repo && for i in $(seq 100); do echo \"line $i\" > f$i.txt; done"
         " && dd if=/dev/urandom of=/repo/blob bs=1M count=4 status=none")


def action(i: int) -> str:
    return (f"cd /repo && echo 'edit {i}' >> f{i % 100 + 1}.txt && python3 -c 'print(sum(range(300000)))'"
            f" && cat f*.txt | wc -l")


def cgroup_memory(cid: str) -> int:
    """Bytes a container's cgroup charges (anon + page cache), cgroup v1 or v2; 0 if unknown."""
    for path in (f"/sys/fs/cgroup/memory/docker/{cid}/memory.usage_in_bytes",
                 f"/sys/fs/cgroup/system.slice/docker-{cid}.scope/memory.current",
                 f"/sys/fs/cgroup/docker/{cid}/memory.current"):
        try:
            return int(Path(path).read_text())
        except (OSError, ValueError):
            continue
    return 0


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler:
    """Peak memory of the bench's containers and actor processes, and the host load, each second."""

    def __init__(self, client, pool: EpisodePool):
        self.client, self.pool = client, pool
        self.peak_containers = self.peak_actors = 0
        self.loads: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                cs = self.client.api.containers(filters={"name": PREFIX})
            except Exception:  # noqa: BLE001 - a busy daemon: skip this sample
                continue
            self.peak_containers = max(self.peak_containers, sum(cgroup_memory(c["Id"]) for c in cs))
            pids = {e.where.get("pid") for e in self.pool.envs if e.where}
            self.peak_actors = max(self.peak_actors, sum(rss(p) for p in pids if p))
            self.loads.append(os.getloadavg()[0])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_size(n: int, steps: int, think_s: float, replica: str, client) -> dict:
    cfg = RayEnvConfig(replica_url=replica, checkpoint_policy="always",
                       env=EnvConfig(sandbox=SandboxConfig(memory="512m", cpus=1.0, name_prefix=PREFIX)))
    latencies: list[float] = []
    lock = threading.Lock()
    window: dict[str, float] = {}
    together = threading.Barrier(n, timeout=600)  # measure only while all n step concurrently

    def agent(env, episode):
        env.reset(options=episode)
        if together.wait() == 0:
            window["start"] = time.monotonic()
        k = 0
        while k < steps:
            time.sleep(think_s)  # the LLM writes the next action (the capture runs meanwhile)
            t = time.monotonic()
            _, _, _, _, info = env.step(action(k + 1))
            with lock:
                latencies.append(time.monotonic() - t)
            k = info["belayer"]["step"]
        with lock:
            window["end"] = time.monotonic()
        return env.checkpoint_stats()

    with EpisodePool(cfg, max_concurrent=n) as pool:
        t0 = time.monotonic()
        sampler = Sampler(client, pool)
        results = list(pool.run([{"task": f"scale-{n}-{i}", "setup": SETUP} for i in range(n)], agent))
        sampler.stop()
        wall = window["end"] - window["start"]
        errors = [repr(r.error) for r in results if r.error]
        uploads = [u for r in results if r.value for u in r.value]
        starts = window["start"] - t0
    ck_bytes = [u["bytes"] for u in uploads]
    up_s = [u["upload_s"] for u in uploads]
    return {
        "sandboxes": n, "steps_per_episode": steps, "think_s": think_s, "errors": errors,
        "committed_steps": n * steps, "wall_s": wall, "steps_per_s": n * steps / wall,
        "step_latency_p50_s": statistics.median(latencies),
        "step_latency_p95_s": sorted(latencies)[int(0.95 * (len(latencies) - 1))],
        "checkpoints": len(uploads), "checkpoints_per_episode": len(uploads) / n,
        "checkpoint_bytes_median": statistics.median(ck_bytes) if ck_bytes else 0,
        "replicated_bytes_per_s": sum(ck_bytes) / wall,
        "upload_s_median": statistics.median(up_s) if up_s else 0,
        "peak_container_memory_bytes": sampler.peak_containers,
        "peak_actor_rss_bytes": sampler.peak_actors,
        "memory_per_sandbox_bytes": (sampler.peak_containers + sampler.peak_actors) / n,
        "load_avg_mean": statistics.mean(sampler.loads) if sampler.loads else os.getloadavg()[0],
        "load_avg_max": max(sampler.loads) if sampler.loads else os.getloadavg()[0],
        "uptime_after": uptime(),
        "all_episodes_ready_s": starts,  # pool start -> every reset done (actors, containers, setup)
    }


def uptime() -> str:
    """``uptime``'s line: the machine is shared, so every figure is read against its load."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"load average: {os.getloadavg()}"


def node_loss_cost(replica: str, client) -> dict:
    """One episode, its actor killed after a replicated checkpoint: what continuing costs."""
    cfg = RayEnvConfig(replica_url=replica, checkpoint_policy="always",
                       env=EnvConfig(sandbox=SandboxConfig(memory="512m", cpus=1.0, name_prefix=PREFIX)))
    out: dict = {}

    def agent(env, episode):
        env.reset(options=episode)
        k = 0
        while env.resume_point is None or env.resume_point["step"] < 3:
            time.sleep(0.5)
            k = env.step(action(k + 1))[4]["belayer"]["step"]
        point = dict(env.resume_point)
        size = next(u["bytes"] for u in env.checkpoint_stats() if u["id"] == point["id"])
        ray.kill(env.actor, no_restart=True)  # its process is gone, as with its node
        t = time.monotonic()
        _, _, _, _, info = env.step(action(k + 1))
        out.update({"failover_s": time.monotonic() - t, "rollback": info["belayer"].get("rollback"),
                    "at_step": k, "resumed_step": info["belayer"]["step"], "checkpoint_bytes_fetched": size})
        return out

    with EpisodePool(cfg, max_concurrent=1) as pool:
        [r] = list(pool.run([{"task": "node-loss", "setup": SETUP}], agent))
    if r.error:
        raise r.error
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--think", type=float, default=1.0, help="think time per step, seconds")
    ap.add_argument("--out", default=str(RESULTS / "scale_bench.json"))
    args = ap.parse_args()
    from belayer_env.sandbox.docker_api import connect

    client = connect()
    shared = Path(tempfile.mkdtemp(prefix="belayer-scale-replica-"))
    replica = shared.as_uri()
    ray.init(num_cpus=os.cpu_count(), resources={SANDBOX_RESOURCE: max(args.sizes)},
             include_dashboard=False, log_to_driver=False)
    rows = []
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    uptime_before = uptime()
    try:
        load_before = os.getloadavg()
        cost = node_loss_cost(replica, client)
        print(f"node loss: continued in {cost['failover_s']:.2f} s from step {cost['resumed_step']} "
              f"({cost['checkpoint_bytes_fetched'] / 1e6:.1f} MB fetched)", flush=True)
        for n in args.sizes:
            row = run_size(n, args.steps, args.think, replica, client)
            rows.append(row)
            print(f"{n:3d} sandboxes: {row['steps_per_s']:6.2f} steps/s, p50 step {row['step_latency_p50_s']:.2f} s, "
                  f"{row['checkpoints']} checkpoints ({row['checkpoint_bytes_median'] / 1e6:.1f} MB each), "
                  f"{row['memory_per_sandbox_bytes'] / 2**20:.0f} MiB/sandbox, load {row['load_avg_mean']:.1f}"
                  + (f", errors: {row['errors']}" if row["errors"] else ""), flush=True)
    finally:
        ray.shutdown()
        shutil.rmtree(shared, ignore_errors=True)
    result = {"benchmark": "scale_bench", "host": platform.node(), "cpus": os.cpu_count(),
              "load_avg_before": load_before,
              "started_utc": started, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "uptime_before": uptime_before, "uptime_after": uptime(), "think_s": args.think, "steps_per_episode": args.steps,
              "checkpoint_policy": "always", "replica": "file:// (local disk)", "node_loss": cost, "sizes": rows}
    save_result(result, args.out, plot)
    print(f"wrote {args.out}")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = result["sizes"]
    n = [r["sandboxes"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(n, [r["steps_per_s"] for r in rows], "o-", label="measured (mean 1-min load beside each point)")
    for r in rows:  # the machine is shared: each point is read against its load
        a.annotate(f"load {r['load_avg_mean']:.0f}", (r["sandboxes"], r["steps_per_s"]),
                   textcoords="offset points", xytext=(4, -12), fontsize=8)
    ideal = [rows[0]["steps_per_s"] * k / rows[0]["sandboxes"] for k in n]
    a.plot(n, ideal, "--", color="grey", label="linear from the smallest size")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrent sandboxes")
    a.set_ylabel("committed steps/s (all sandboxes)")
    a.set_title(f"throughput, checkpoint after every step, think {result['think_s']:g} s")
    a.legend()
    b.plot(n, [r["peak_container_memory_bytes"] / 2**20 for r in rows], "o-", label="sandboxes (cgroup)")
    b.plot(n, [r["peak_actor_rss_bytes"] / 2**20 for r in rows], "s-", label="env actors (RSS)")
    b.set_xscale("log", base=2)
    b.set_xlabel("concurrent sandboxes")
    b.set_ylabel("peak memory, MiB")
    b.set_title(f"memory ({result['cpus']} CPUs, load {result['load_avg_before'][0]:.0f} before)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
