"""Per failure kind, locally: detection time, recovery time and steps lost.

Four emulated nodes x 1 rank, the tiny model, 8 steps, checkpoints every 2; the fault after
step 3. Restart: one copy of the state sharded over all 4 (the re-plan keeps 3 whole
replicas, the batch split unevenly); in place: 4 copies (layout.dp_shard=1), the 3 left go on.
Detection: failure to the launcher's verdict (a hang: the progress deadline, set to 8 s here);
recovery: failure to the first step completed after it.

Run: .venv/bin/python benchmarks/failure_kinds.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ["hardware=cpu", "model=tiny", "launcher=local", "figures=false", "training.seq_len=64",
        "training.global_batch=16", "cluster.nodes=4", "hardware.gpus_per_node=1", "layout.dp=4",
        "training.steps=8", "training.checkpoint.every=2", "fault.at_step=3", "failover.quorum_s=5",
        "failover.progress_deadline_s=8"]
KINDS = {
    "kill_node, restart": ["fault.kill_node=1"],
    "kill_node, in place": ["fault.kill_node=1", "layout.dp_shard=1"],
    "crash_rank, restart": ["fault.kind=crash_rank", "fault.rank=1"],
    "crash_rank, in place": ["fault.kind=crash_rank", "fault.rank=1", "layout.dp_shard=1"],
    "hang_rank, restart": ["fault.kind=hang_rank", "fault.rank=1"],
    "two nodes, restart": ["fault.kill_node=[1,2]"],  # lost together: one decision (launch/failover.py)
    "two nodes, in place": ["fault.kill_node=[1,2]", "layout.dp_shard=1"],
}


def measure(run: Path) -> str:
    events = [e for e in json.loads((run / "failover.json").read_text()) if e["mode"] != "in_place_refused"]
    ev = events[0]
    n = f"{len(events)} failover(s), " if len(events) > 1 else ""
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    if ev["mode"] == "restart":
        s = ev["seconds"]
        failed_at = ev["time"] - s["replan"] - (s["detection"] or 0.0)
        first = min((r for r in steps if r["attempt"] == ev["attempt"] + 1), key=lambda r: r["time"])
        detection = "unknown" if s["detection"] is None else f"{s['detection']:.2f} s"
        return (f"{n}restart: detection {detection}, recovery {first['time'] - failed_at:.2f} s, "
                f"{ev['steps_lost']} step(s) lost, dp {ev['old_layout']['dp']} -> {ev['new_layout']['dp']}")
    return (f"{n}{ev['mode']}: recovery {ev['recovery_s']:.2f} s (detection to the first step after), "
            f"{ev['steps_lost']} step(s) lost, {ev['steps_redone']} redone, dp {ev['old_layout']['dp']} -> "
            f"{ev['new_layout']['dp']}")


def main() -> None:
    for name, extra in KINDS.items():
        if len(sys.argv) > 1 and not any(a in name for a in sys.argv[1:]):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(tmp) / "run"
            r = subprocess.run([sys.executable, "-m", "orchestrator", *BASE, *extra, f"hydra.run.dir={run}"],
                               cwd=ROOT, capture_output=True, text=True, timeout=900)
            status = json.loads((run / "status.json").read_text())
            print(f"{name:<22} exit {r.returncode}, {status['state']}: {measure(run)}", flush=True)


if __name__ == "__main__":
    main()
