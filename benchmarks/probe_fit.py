"""Predicted (from measured components) against measured steps of tiny-model layouts on this machine.

First `orchestrate-calibrate --probe` (orchestrator/probe.py) measures this machine's GEMM rate,
memory bandwidth, per-op overhead and gloo collectives and builds the site preset; then each
layout below trains a few steps of `model=tiny` with launcher=local (one at a time, nice), and
the script prints, per layout, the step the site preset predicts (and its parts), the median
measured step (first step left out) and their ratio. Nothing is fitted on these runs.

Run: .venv/bin/python benchmarks/probe_fit.py [--steps 6] [--ranks 2]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # name -> overrides (1-8 ranks)
    "single": ["cluster.nodes=1", "hardware.gpus_per_node=1"],
    "TP2": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.tp=2"],
    "DP2": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.dp=2"],
    "PP2": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.pp=2", "schedule=1f1b"],
    "CP2": ["cluster.nodes=1", "hardware.gpus_per_node=2", "layout.cp=2"],
    "TP2xDP2": ["cluster.nodes=2", "hardware.gpus_per_node=2", "layout.tp=2", "layout.dp=2"],
    "CP2xPP2": ["cluster.nodes=1", "hardware.gpus_per_node=4", "layout.cp=2", "layout.pp=2", "schedule=1f1b"],
    "demo": ["cluster.nodes=2", "hardware.gpus_per_node=4", "layout.tp=2", "layout.pp=2", "layout.dp=2",
             "schedule=1f1b"],  # make demo's layout (8 processes)
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ranks", type=int, default=2, help="processes for the gloo probe")
    args = ap.parse_args()
    from omegaconf import OmegaConf

    from orchestrator import compose, make_plan
    from orchestrator.config.compose import to_dict
    from orchestrator.measure import probe_overrides
    from orchestrator.plan.artifacts import read_steps, step_stats
    from orchestrator.rundir import timed

    tmp = Path(tempfile.mkdtemp(prefix="probe_fit_"))
    # The probe at the runs' own priority (nice 10): on a shared host both get the same share.
    subprocess.run(["nice", "-n", "10", sys.executable, "-m", "orchestrator.measure", "--probe", "--ranks",
                    str(args.ranks), "--write", str(tmp / "hardware-site.yaml")], cwd=ROOT, check=True)
    hw = OmegaConf.to_container(OmegaConf.load(tmp / "hardware-site.yaml"))
    site = probe_overrides(hw, to_dict(compose(["hardware=cpu"]))["hardware"])
    common = ["model=tiny", f"training.steps={args.steps}", "figures=false"]
    print(f"\n{'layout':<9} {'predicted':>10} {'measured':>10} {'meas/pred':>9} {'min':>8} {'stock':>8}   "
          f"predicted parts (s); measured = median step (first left out), min = fastest; stock = hardware=cpu")
    for name, lay in LAYOUTS.items():
        plan = make_plan(compose(site + common + lay))
        run = tmp / name
        r = subprocess.run(["nice", "-n", "10", sys.executable, "-m", "orchestrator", *site, *common, *lay,
                            "launcher=local", f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        steps = [float(x["step_time_s"]) for x in timed(read_steps(run))] if r.returncode == 0 else []
        if not steps:
            print(f"{name:<9} {plan.step.wall_s:10.3f} {'failed':>10}   {r.stderr[-200:]}")
            continue
        meas = step_stats(steps)["median_s"]
        stock = make_plan(compose(["hardware=cpu"] + common + lay)).step.wall_s
        parts = ", ".join(f"{k} {v:.3f}" for k, v in plan.step.wall.items() if v > 0)
        print(f"{name:<9} {plan.step.wall_s:10.3f} {meas:10.3f} {meas / plan.step.wall_s:9.2f} {min(steps[1:]):8.3f} "
              f"{stock:8.3f}   {parts}")
    print(f"\nrun directories under {tmp}")


if __name__ == "__main__":
    main()
