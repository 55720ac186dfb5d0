"""Per failure kind, locally and on the local SLURM cluster: detection time, recovery time and
steps lost.

Locally: four emulated nodes x 1 rank, the tiny model, 8 steps, checkpoints every 2; the fault
after step 3. Restart: one copy of the state sharded over all 4 (the re-plan keeps 3 whole
replicas, the batch split unevenly); in place: 4 copies (layout.dp_shard=1), the 3 left go on.
A slow node (fault.kind=slow_node, 0.5 s more a step from step 1): named a straggler after
failover.straggler_steps=3 steps, kept without a spare, moved to a warm spare with one.

--slurm: the same kinds in detached jobs on the local SLURM cluster (slurm/local-cluster.sh,
2 nodes x 2 ranks, dp 4, 12 steps, checkpoints every 2; in place: 2 copies of 2 ranks, one a
node), the fault after step 5: kill_node kills node2's slurmd and steps (slurm/kill-node.sh) once
5 steps are done; the rank kinds strike rank 3 (on the second node). Run it under
`flock /tmp/slurm-cluster.lock`: it brings the cluster up and down.

Detection: failure to the supervisor's verdict (a hang: the progress deadline, 8 s locally,
10 s on SLURM; a straggler: the slowdown's first step to its naming); recovery: failure to the
first step completed after it.

Run: .venv/bin/python benchmarks/failure_kinds.py [--slurm] [name filter ...]
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["hardware=cpu", "model=tiny", "figures=false", "training.seq_len=64", "training.global_batch=16",
          "training.checkpoint.every=2", "failover.quorum_s=5"]
BASE = [*COMMON, "launcher=local", "cluster.nodes=4", "hardware.gpus_per_node=1", "layout.dp=4",
        "training.steps=8", "fault.at_step=3", "failover.progress_deadline_s=8"]
SLOW = ["fault.kind=slow_node", "fault.kill_node=1", "fault.at_step=1", "fault.slow_s=0.5",
        "failover.straggler_steps=3"]
KINDS = {
    "kill_node, restart": ["fault.kill_node=1"],
    "kill_node, in place": ["fault.kill_node=1", "layout.dp_shard=1"],
    "crash_rank, restart": ["fault.kind=crash_rank", "fault.rank=1"],
    "crash_rank, in place": ["fault.kind=crash_rank", "fault.rank=1", "layout.dp_shard=1"],
    "hang_rank, restart": ["fault.kind=hang_rank", "fault.rank=1"],
    "slow_node, kept": [*SLOW, "layout.dp_shard=1"],
    "slow_node, to a spare": [*SLOW, "layout.dp_shard=1", "cluster.spare_nodes=1", "failover.evict_stragglers=true"],
    "two nodes, restart": ["fault.kill_node=[1,2]"],  # lost together: one decision (launch/failover.py)
    "two nodes, in place": ["fault.kill_node=[1,2]", "layout.dp_shard=1"],
}
SLURM = [*COMMON, "launcher=slurm", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4", "training.steps=12",
         "failover.progress_deadline_s=10"]
AT = 5  # the SLURM fault's step
SLURM_KINDS = {
    "kill_node, restart": [],
    "kill_node, in place": ["layout.dp_shard=2"],
    "crash_rank, restart": ["fault.kind=crash_rank", "fault.rank=3", f"fault.at_step={AT}"],
    "crash_rank, in place": ["fault.kind=crash_rank", "fault.rank=3", f"fault.at_step={AT}", "layout.dp_shard=2"],
    "hang_rank, restart": ["fault.kind=hang_rank", "fault.rank=3", f"fault.at_step={AT}"],
    "slow_node, kept": ["fault.kind=slow_node", "fault.kill_node=1", "fault.at_step=1", "fault.slow_s=0.5",
                        "failover.straggler_steps=3", "layout.dp_shard=2"],
}
CLUSTER_ENV = {"NODES": "2", "GPUS": "4", "CPUS": "8"}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def measure(run: Path, killed_at: float | None = None) -> str:
    events = [e for e in json.loads((run / "failover.json").read_text()) if e["mode"] != "in_place_refused"]
    if not events:
        return "no failover event"
    # a straggler named on a loaded machine beside the fault is said, not counted as a failover
    others = [e for e in events if e["mode"] != "straggler"]
    stragglers = len(events) - len(others) if others else 0
    events = others or events
    steps = _metrics(run)
    ev = events[0]
    n = (f"{len(events)} failover(s), " if len(events) > 1 and events[0]["mode"] != "straggler" else "") + (
        f"{stragglers} straggler(s) named, " if stragglers else "")
    if ev["mode"] == "straggler":
        begun = max((r["time"] for r in steps if r["step"] == ev["step"] - ev["steps"]), default=None)
        named = f"named after {ev['steps']} steps ({ev['ratio']:.2f}x the median)" + (
            f", {ev['time'] - begun:.2f} s after the slowdown began" if begun else "")
        if not ev["evicted"]:
            return f"straggler: {named}; kept ({ev['action'].split(': ', 1)[1]}), 0 steps lost"
        moved = events[1]
        return (f"straggler: {named}; to a spare: recovery {moved['recovery_s']:.2f} s (eviction to the first step "
                f"after), {moved['steps_lost']} step(s) lost, dp {moved['old_layout']['dp']} -> "
                f"{moved['new_layout']['dp']}")
    if ev["mode"] == "restart":
        s = ev["seconds"]
        decided = ev["time"] - s["replan"]
        failed_at = killed_at if killed_at is not None else decided - (s["detection"] or 0.0)
        first = min((r for r in steps if r["attempt"] == ev["attempt"] + 1), key=lambda r: r["time"])
        detection = (f"{decided - killed_at:.2f} s" if killed_at is not None else
                     "unknown" if s["detection"] is None else f"{s['detection']:.2f} s")
        return (f"{n}restart: detection {detection}, recovery {first['time'] - failed_at:.2f} s, "
                f"{ev['steps_lost']} step(s) lost, dp {ev['old_layout']['dp']} -> {ev['new_layout']['dp']}")
    if killed_at is None:
        detection, recovery = "", ev["recovery_s"]
    else:  # the coordinator may decide before the supervisor sees the node down: from the kill to the decision
        detection = f"detection {(ev.get('detected_at') or ev['decided_at']) - killed_at:.2f} s, "
        recovery = min(r["time"] for r in steps if r["attempt"] == ev["attempt"]) - killed_at
    return (f"{n}{ev['mode']}: {detection}recovery {recovery:.2f} s (to the first step after), "
            f"{ev['steps_lost']} step(s) lost, {ev['steps_redone']} redone, dp {ev['old_layout']['dp']} -> "
            f"{ev['new_layout']['dp']}")


def local(names) -> None:
    for name, extra in KINDS.items():
        if names and not any(a in name for a in names):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            r = subprocess.run([sys.executable, "-m", "orchestrator", *BASE, *extra, f"hydra.run.dir={run}"],
                               cwd=ROOT, capture_output=True, text=True, timeout=900)
            status = json.loads((run / "status.json").read_text())
            print(f"local {name:<22} exit {r.returncode}, {status['state']}: {measure(run)}", flush=True)


def _slurm_run(run: Path, extra: list[str], kill: bool) -> tuple[str, float | None]:
    r = subprocess.run([sys.executable, "-m", "orchestrator", *SLURM, *extra, f"hydra.run.dir={run}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        return f"not submitted: {r.stderr[-500:]}", None
    killed_at, state, deadline = None, None, time.monotonic() + 900
    while time.monotonic() < deadline and state not in ("completed", "failed", "stopped", "cancelled"):
        if kill and killed_at is None and (run / "metrics.jsonl").exists() and \
                len(_metrics(run)) >= AT:
            killed_at = time.time()
            subprocess.run([str(ROOT / "slurm" / "kill-node.sh"), "node2"], check=True, timeout=30)
        try:
            state = json.loads((run / "status.json").read_text()).get("state")
        except (OSError, ValueError):
            pass
        time.sleep(0.3)
    return state or "unknown", killed_at


def slurm(names) -> None:
    script = ROOT / "slurm" / "local-cluster.sh"
    env = dict(os.environ, **CLUSTER_ENV)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still takes the cluster down
    subprocess.run([str(script), "up"], env=env, check=True, capture_output=True, timeout=900)
    os.environ["SLURM_CONF"] = subprocess.run([str(script), "conf"], capture_output=True, text=True).stdout.strip()
    try:
        for name, extra in SLURM_KINDS.items():
            if names and not any(a in name for a in names):
                continue
            with tempfile.TemporaryDirectory() as tmp:
                run = Path(tmp) / "run"
                state, killed_at = _slurm_run(run, extra, kill=name.startswith("kill_node"))
                try:
                    what = measure(run, killed_at)
                except (OSError, ValueError, KeyError, IndexError) as e:
                    what = f"not measured ({type(e).__name__}: {e})"
                print(f"slurm {name:<22} {state}: {what}", flush=True)
            if name.startswith("kill_node"):
                subprocess.run([str(script), "up"], env=env, capture_output=True, timeout=300)  # node2 back
    finally:
        subprocess.run([str(script), "down"], env=env, capture_output=True, timeout=120)


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--slurm"]
    if "--slurm" in sys.argv[1:]:
        slurm(args)
    else:
        local(args)


if __name__ == "__main__":
    main()
