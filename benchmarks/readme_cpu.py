"""The README's hardware=cpu examples on this machine: measured step against the predicted one,
with the stock preset (no measurement of this machine) and with this machine's cached probe
(`orchestrate-calibrate --probe`, plan/machine.py), nothing fitted on these runs.

Each example runs its layout (the README's overrides without the fault injection) with
launcher=local, `--runs` times, one at a time; the measurement is the median step after the
warm-up of each run, and the lowest of those medians (other load on a shared host comes and
goes). The probe is taken from the cache the environment names (ORCHESTRATOR_CACHE_DIR); the
stock prediction is planned in an empty cache. Prints per example: predicted (stock, measured
model), measured, measured/predicted, and how many land within 20%.

Run: ORCHESTRATOR_CACHE_DIR=DIR .venv/bin/python benchmarks/readme_cpu.py [--steps 12] [--runs 2] [--only NAME]
(first: ORCHESTRATOR_CACHE_DIR=DIR .venv/bin/orchestrate-calibrate --probe)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CPU = ["hardware=cpu"]
EXAMPLES = {  # README section -> its layout's overrides
    "demo (make demo)": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2",
                         "layout.dp=2", "schedule=1f1b"],
    "moe": ["model=tiny_moe", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.ep=4", "layout.pp=2"],
    "failover tp2": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2"],
    "in-place dp4/shard2": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=2", "layout.dp=4",
                            "layout.dp_shard=2"],
    "slurm tp2 pp2": ["model=tiny", "cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2"],
    "sweep tp1 pp1": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=1", "layout.pp=1"],
    "sweep tp1 pp2": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=1", "layout.pp=2"],
    "sweep tp2 pp1": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=1"],
    "sweep tp2 pp2": ["model=tiny", "cluster.nodes=1", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2"],
}


def predicted(overrides: list[str], cache: str) -> float:
    env = dict(os.environ, ORCHESTRATOR_CACHE_DIR=cache)
    code = ("import sys; from orchestrator import compose, make_plan; "
            "print(make_plan(compose(sys.argv[1:])).step.wall_s)")
    r = subprocess.run([sys.executable, "-c", code, *overrides], cwd=ROOT, env=env, capture_output=True, text=True,
                       check=True)
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="example names (default: all)")
    args = ap.parse_args()
    from orchestrator import rundir
    from orchestrator.rundir import read_steps, timed

    cache = os.environ.get("ORCHESTRATOR_CACHE_DIR")
    empty = tempfile.mkdtemp(prefix="readme_cpu_nocache_")
    tmp = Path(tempfile.mkdtemp(prefix="readme_cpu_"))
    common = [f"training.steps={args.steps}", "figures=false"]
    print(f"{'example':<22} {'stock':>8} {'measured-model':>14} {'measured':>9} {'meas/stock':>10} {'meas/model':>10}")
    within = {"stock": 0, "model": 0}
    n = 0
    for name, lay in EXAMPLES.items():
        if args.only and name not in args.only:
            continue
        over = CPU + lay + common
        stock = predicted(over, empty)
        model = predicted(over, cache) if cache else float("nan")
        medians = []
        for k in range(args.runs):
            run = tmp / f"{name.split()[0]}-{n}-{k}"
            env = dict(os.environ, ORCHESTRATOR_CACHE_DIR=cache or empty)
            r = subprocess.run([sys.executable, "-m", "orchestrator", *over, "launcher=local", f"hydra.run.dir={run}"],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            got = [float(x["step_time_s"]) for x in timed(read_steps(run))] if r.returncode == 0 else []
            if got:
                medians.append(rundir.measured_step_s(got))
            else:
                print(f"  {name}: run {k} failed: {r.stderr[-300:]}")
        n += 1
        if not medians:
            continue
        meas = min(medians)
        within["stock"] += 0.8 <= meas / stock <= 1.2
        within["model"] += 0.8 <= meas / model <= 1.2
        print(f"{name:<22} {stock:8.3f} {model:14.3f} {meas:9.3f} {meas / stock:10.2f} {meas / model:10.2f}   "
              f"(medians {', '.join(f'{m:.3f}' for m in medians)})", flush=True)
    print(f"\nwithin 20%: stock preset {within['stock']} of {n}, measured model {within['model']} of {n}")


if __name__ == "__main__":
    main()
