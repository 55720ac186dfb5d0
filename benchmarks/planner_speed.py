"""Planner speed: the dry run as a user runs it, next to a bare Hydra app composing the
same config tree, in one run, side by side.

Three commands per configuration, each a new process, run in turns (so a busy machine
slows them alike):
  bare Hydra   a @hydra.main app (written into a temporary folder) on conf/ with the
               orchestrator schema registered, composing the same overrides and doing nothing
               else (Hydra still writes its .hydra/ folder and log, as any Hydra app does)
  dry run      python -m orchestrator ... launcher=dry: compose, plan, print the table,
               plan.json/plan.md, cluster.png and step_budget.png (the default)
  figures=false the same without the two pictures
It prints the median wall time (what the user waits for; the figure the 1.2x target is
about) and the median CPU time (user + system of the child, its threads and its children:
numpy's OpenBLAS threads and the manifest's git calls count here, and can exceed the wall
time on two cores) of each, and the ratios to bare Hydra. Then a 1,000-point dry sweep
(`orchestrate -m`, 4 x 5 x 2 x 5 x 5 values over Llama-3-70B on 512 GPUs: every point planned and
its plan.json written; the target is 10 s), and the in-process make_plan and compose times.

The children run with bytecode caching on, as an installed package runs (pip writes the
.pyc files): PYTHONDONTWRITEBYTECODE is dropped and the caches go to a temporary folder
(PYTHONPYCACHEPREFIX), filled by a first round that is not counted. Without caches every
run would compile the orchestrator's modules from source, a cost the bare app mostly avoids.

Run: .venv/bin/python benchmarks/planner_speed.py [--runs N] [--config SUBSTRING] [--no-sweep]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "README's Llama-3-70B example (512 GPUs)": ["hardware=h100_sxm", "model=llama3_70b", "cluster.nodes=64", "layout.tp=8",
                                               "layout.cp=1", "layout.pp=1", "layout.dp=64", "training.seq_len=8192",
                                               "training.global_batch=2048", "training.micro_batch=1",
                                               "cost.attention_flops=false"],
    "demo (8 CPU processes)": ["hardware=cpu", "cluster.nodes=2", "hardware.gpus_per_node=4", "model=tiny",
                               "layout.tp=2", "layout.pp=2", "layout.dp=2", "schedule=1f1b"],
    "recipe=llama3_405b (8,192 GPUs)": ["recipe=llama3_405b"],
}

SWEEP = ["model=llama3_70b", "cluster.nodes=64", "layout.tp=1,2,4,8", "layout.pp=1,2,4,8,16", "training.micro_batch=1,2",
         "training.global_batch=1024,2048,4096,8192,16384", "training.seq_len=2048,4096,8192,16384,32768"]

BARE_APP = """\
import sys
sys.path.insert(0, {root!r})
import hydra
from orchestrator.config.compose import register
from orchestrator.config.paths import CONF_DIR

register()  # the orchestrator schema, launchers, schedules and recipes in Hydra's ConfigStore


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def app(cfg) -> None:
    return None


if __name__ == "__main__":
    app()
"""


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child) of one command."""
    before = os.times()
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=env)
    wall = time.perf_counter() - t0
    after = os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--config", default="", help="only the configurations whose name contains this")
    ap.add_argument("--no-sweep", action="store_true", help="skip the 1,000-point sweep and the in-process times")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare_hydra_app.py"
        bare.write_text(BARE_APP.format(root=str(ROOT)))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        for name, overrides in CONFIGS.items():
            if args.config not in name:
                continue
            variants = {
                "bare Hydra app": [sys.executable, str(bare), *overrides],
                "dry run (figures)": [sys.executable, "-m", "orchestrator", *overrides, "launcher=dry"],
                "dry run, figures=false": [sys.executable, "-m", "orchestrator", *overrides, "launcher=dry",
                                           "figures=false"],
            }
            walls: dict[str, list[float]] = {k: [] for k in variants}
            cpus: dict[str, list[float]] = {k: [] for k in variants}
            for i in range(args.runs + 1):  # the first round warms the file cache and is dropped
                order = list(variants)
                random.Random(i).shuffle(order)
                for k in order:
                    w, c = timed(variants[k] + [f"hydra.run.dir={tmp}/{abs(hash((name, k)))}/{i}"], env)
                    if i:
                        walls[k].append(w)
                        cpus[k].append(c)
            print(f"{name}: median of {args.runs} runs each, interleaved")
            base_w, base_c = statistics.median(walls["bare Hydra app"]), statistics.median(cpus["bare Hydra app"])
            for k in variants:
                w, c = statistics.median(walls[k]), statistics.median(cpus[k])
                print(f"  {k:<24} wall {w:6.3f} s ({w / base_w:4.2f}x)   CPU {c:6.3f} s ({c / base_c:4.2f}x)")
            mins = {k: (min(walls[k]), min(cpus[k])) for k in variants}
            print("  min of the runs: " + ", ".join(f"{k} {w / mins['bare Hydra app'][0]:.2f}x wall, "
                                                    f"{c / mins['bare Hydra app'][1]:.2f}x CPU"
                                                    for k, (w, c) in mins.items() if k != "bare Hydra app"))
        if args.no_sweep:
            return
        sweep = [sys.executable, "-m", "orchestrator", "-m", *SWEEP]
        walls, cpus = zip(*(timed(sweep + [f"hydra.sweep.dir={tmp}/sweep{i}"], env) for i in range(2)))
        print(f"1,000-point dry sweep (orchestrate -m): wall {min(walls):6.2f} s   CPU {min(cpus):6.2f} s "
              f"(best of 2; {min(walls):.1f} ms a point)")
    from orchestrator import compose, make_plan

    cfg = compose(["recipe=llama3_405b"])
    make_plan(cfg)
    times = []
    for _ in range(max(args.runs * 4, 20)):
        t0 = time.perf_counter()
        make_plan(cfg)
        times.append(time.perf_counter() - t0)
    print(f"make_plan (in process, recipe=llama3_405b): median {statistics.median(times) * 1e3:.1f} ms "
          f"over {len(times)} calls")
    t0 = time.perf_counter()
    compose(["recipe=llama3_405b"])
    print(f"compose (Hydra, in process): {(time.perf_counter() - t0) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
