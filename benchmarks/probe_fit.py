"""Predicted (from measured components) against measured steps of tiny-model layouts on this machine.

First `orchestrate-calibrate --probe` (orchestrator/probe.py) measures this machine's GEMM rate,
memory bandwidth, per-op overhead and gloo collectives and builds the site preset; then each
layout below trains a few steps of `model=tiny` with launcher=local (one at a time, nice), and
the script prints, per layout, the step the site preset predicts (and its parts), the fastest
measured step (first step and the two profiled ones left out; the host is shared, so the least
disturbed step is the measurement, the median beside it), their ratio, the stock `cpu` preset's
prediction, the cores' worth the probe found for its ranks, and the profiled step's measured parts
(profile.json). By default the probe runs again right before each layout, at the runs' priority,
so both see the same other load. Nothing is fitted on these runs.

Run: .venv/bin/python benchmarks/probe_fit.py [--steps 8] [--probe-once] [--ranks 2]
"""
from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2, help="processes for the gloo probe")
    ap.add_argument("--nice", type=int, default=10, help="niceness of the probe and the runs (both the same)")
    ap.add_argument("--probe-once", dest="probe_each", action="store_false",
                    help="one probe for every layout (default: probe again before each run)")
    args = ap.parse_args()
    from omegaconf import OmegaConf

    from orchestrator import compose, make_plan
    from orchestrator.config.compose import to_dict
    from orchestrator.measure import probe_overrides
    from orchestrator.rundir import PROFILE_JSON, read_steps, timed
    from orchestrator.rundir.metrics import step_stats

    tmp = Path(tempfile.mkdtemp(prefix="probe_fit_"))
    base = to_dict(compose(["hardware=cpu"]))["hardware"]
    common = ["model=tiny", f"training.steps={args.steps}", "figures=false"]

    def probe(name: str) -> tuple[list[str], dict]:
        """The probe at the runs' own priority (--nice), just before the run: on a shared host the
        other load changes by the minute, and probe and run should see the same."""
        out = tmp / f"hardware-site-{name}.yaml"
        subprocess.run(["nice", "-n", str(args.nice), sys.executable, "-m", "orchestrator.measure", "--probe", "--ranks",
                        str(args.ranks), "--write", str(out)], cwd=ROOT, check=True, capture_output=True)
        hw = OmegaConf.to_container(OmegaConf.load(out))
        return probe_overrides(hw, base), hw

    site, hw = probe("first")
    if not args.probe_each:
        print("site preset: " + " ".join(site))
    print(f"\n{'layout':<9} {'predicted':>10} {'measured':>10} {'meas/pred':>9} {'median':>8} {'stock':>8} "
          f"{'cores':>6}   predicted parts | measured parts of the profiled step (s)")
    for name, lay in LAYOUTS.items():
        if args.probe_each:
            site, hw = probe(name)
        plan = make_plan(compose(site + common + lay))
        run = tmp / name
        r = subprocess.run(["nice", "-n", str(args.nice), sys.executable, "-m", "orchestrator", *site, *common, *lay,
                            "launcher=local", f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600)
        steps = [float(x["step_time_s"]) for x in timed(read_steps(run))] if r.returncode == 0 else []
        if not steps:
            print(f"{name:<9} {plan.step.wall_s:10.3f} {'failed':>10}   {r.stderr[-200:]}")
            continue
        med = step_stats(steps)["median_s"]
        meas = min(steps[1:] or steps)  # the fastest step after the first: the least disturbed by other load
        stock = make_plan(compose(["hardware=cpu"] + common + lay)).step.wall_s
        parts = " ".join(f"{k} {v:.3f}" for k, v in plan.step.wall.items() if v > 0)
        prof = run / PROFILE_JSON
        got = " ".join(f"{k} {v:.3f}" for k, v in json.loads(prof.read_text())["parts_s"].items() if v > 1e-4) \
            if prof.exists() else "-"
        print(f"{name:<9} {plan.step.wall_s:10.3f} {meas:10.3f} {meas / plan.step.wall_s:9.2f} {med:8.3f} "
              f"{stock:8.3f} {hw['host_cores']:6.2f}   {parts} | {got}", flush=True)
    print(f"\nrun directories under {tmp}")


if __name__ == "__main__":
    main()
