"""Planner speed: median wall time of a full dry run (a new process, Hydra compose,
plan, plan.json/plan.md, no figures) and of one in-process make_plan call.

Run: .venv/bin/python benchmarks/planner_speed.py [--runs N]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    from orchestrator import compose, make_plan

    with tempfile.TemporaryDirectory() as tmp:
        walls = []
        for i in range(args.runs):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "orchestrator", "recipe=llama3_405b", "launcher=dry",
                            "figures=false", f"hydra.run.dir={tmp}/{i}"], cwd=ROOT, check=True,
                           capture_output=True)
            walls.append(time.perf_counter() - t0)
    print(f"dry run (new process, 8,192-GPU Llama 3 405B recipe): median {statistics.median(walls):.3f} s "
          f"over {args.runs} runs")
    cfg = compose(["recipe=llama3_405b"])
    make_plan(cfg)
    times = []
    for _ in range(max(args.runs * 4, 20)):
        t0 = time.perf_counter()
        make_plan(cfg)
        times.append(time.perf_counter() - t0)
    print(f"make_plan (in process, same config): median {statistics.median(times) * 1e3:.1f} ms "
          f"over {len(times)} calls")
    t0 = time.perf_counter()
    compose(["recipe=llama3_405b"])
    print(f"compose (Hydra, in process): {(time.perf_counter() - t0) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
