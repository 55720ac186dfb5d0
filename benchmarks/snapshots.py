"""Memory snapshots (train/keeper.py) at tiny scale, locally: what a snapshot costs a step, and the
steps a node loss costs with and without them.

Cost: 2 emulated nodes x 2 ranks (TP2 x DP2), the tiny model, 10 steps, a snapshot every step, no
checkpoint; each snapshot's blocking part (the state staged: a CPU copy) and its background part
(DCP into memory, handed to the two keepers) from rank 0's log, and the median step beside the
same run without snapshots.

Steps lost: the same layout, 12 steps, a checkpoint every 4, node 1 killed after step 7 (the
launcher kills it once 7 steps are done; the ranks may have gone on a little): the restart resumes
from the checkpoint (step 4), or with a snapshot every step from the newest one its buddy holds.

Run: .venv/bin/python benchmarks/snapshots.py
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["hardware=cpu", "model=tiny", "figures=false", "training.seq_len=64", "training.global_batch=16",
          "launcher=local", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.tp=2"]
SNAP = re.compile(r"snapshot of step (\d+) held .* staged in ([\d.]+) ms .* sent in ([\d.]+) ms")


def run(tmp: Path, name: str, *overrides: str) -> tuple[Path, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "orchestrator", *COMMON, *overrides, f"hydra.run.dir={tmp / name}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"{name} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return tmp / name, time.monotonic() - t0


def step_times(rd: Path) -> list[float]:
    return [json.loads(x)["step_time_s"] for x in (rd / "metrics.jsonl").read_text().splitlines()][1:]


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print("cost of a snapshot (TP2 x DP2 on 2 x 2, tiny model, 10 steps):")
        base, base_wall = run(tmp, "plain", "training.steps=10")
        snap, snap_wall = run(tmp, "snap", "training.steps=10", "training.checkpoint.snapshot_every=1")
        found = [SNAP.search(x) for x in (snap / "logs" / "rank0.log").read_text().splitlines()]
        staged = [float(m.group(2)) for m in found if m]
        sent = [float(m.group(3)) for m in found if m]
        print(f"  {len(staged)} snapshots: staged (blocking) median {statistics.median(staged):.1f} ms, "
              f"max {max(staged):.1f} ms; written and sent (background) median {statistics.median(sent):.1f} ms")
        print(f"  median step {statistics.median(step_times(base)) * 1e3:.0f} ms without, "
              f"{statistics.median(step_times(snap)) * 1e3:.0f} ms with snapshots; run wall {base_wall:.0f} s vs "
              f"{snap_wall:.0f} s")
        print("steps lost when node 1 dies after step 7 (checkpoint every 4, 12 steps):")
        for name, extra in (("checkpoint only", []), ("snapshot every step", ["training.checkpoint.snapshot_every=1"])):
            rd, _ = run(tmp, name.replace(" ", "_"), "training.steps=12", "training.checkpoint.every=4",
                        "fault.kill_node=1", "fault.at_step=7", *extra)
            (e,) = [e for e in json.loads((rd / "failover.json").read_text()) if e.get("mode") == "restart"]
            print(f"  {name:20s} failed after step {e['failed_after_step']}, resumed from "
                  f"{e.get('resumed_from', 'checkpoint')} step {e['resumed_from_step']}: {e['steps_lost']} step(s) lost")


if __name__ == "__main__":
    main()
