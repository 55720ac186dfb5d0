"""Predicted (from measured components) against measured steps of tiny-model layouts on this machine.

First `orchestrate-calibrate --probe` (orchestrator/probe.py) measures this machine's GEMM rate,
memory bandwidth, per-op overhead, gloo collectives and the runtime's own model under each
parallelism, three times seconds apart, each figure the quietest of them, and builds the site
preset; then each layout below trains `--steps` steps of `model=tiny` with launcher=local,
`--runs` times, one at a time. The measurement is the fastest step of its runs (first step and
the two profiled ones left out): on a shared host other load comes and goes over seconds, and
both sides take the machine at its quietest. The script prints, per layout, the predicted step
(and its parts), the measurement, their ratio, the median step, the stock `cpu` preset's
prediction, and the profiled step's measured parts (profile.json); then how many layouts are
within 20%. Nothing is fitted on these runs.

Run: .venv/bin/python benchmarks/probe_fit.py [--steps 12] [--runs 2] [--repeat 3] [--ranks 2]
"""
from __future__ import annotations

import argparse
import json
import os
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
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runs", type=int, default=2, help="runs of each layout (the fastest step of all counts)")
    ap.add_argument("--repeat", type=int, default=3, help="probes (each figure the quietest of them)")
    ap.add_argument("--ranks", type=int, default=2, help="processes whose share of the cores the probe measures")
    args = ap.parse_args()
    from omegaconf import OmegaConf

    from orchestrator import compose, make_plan
    from orchestrator.config.compose import to_dict
    from orchestrator.measure import probe_overrides
    from orchestrator.rundir import PROFILE_JSON, read_steps, timed
    from orchestrator.rundir.metrics import step_stats

    tmp = Path(tempfile.mkdtemp(prefix="probe_fit_"))
    # the probe caches its measurement (plan/machine.py): here in a folder of this run's, so the
    # user's cache stays as it was, and the stock column plans in an empty one
    os.environ["ORCHESTRATOR_CACHE_DIR"] = str(tmp / "cache")
    base = to_dict(compose(["hardware=cpu"]))["hardware"]
    common = ["model=tiny", f"training.steps={args.steps}", "figures=false"]
    out = tmp / "hardware-site.yaml"
    subprocess.run([sys.executable, "-m", "orchestrator.measure", "--probe", "--ranks", str(args.ranks), "--repeat",
                    str(args.repeat), "--write", str(out)], cwd=ROOT, check=True, capture_output=True)
    hw = OmegaConf.to_container(OmegaConf.load(out))
    site = probe_overrides(hw, base)
    print(f"site preset ({hw['host_cores']:g} cores' worth for {args.ranks} ranks): " + " ".join(site))
    ratios: dict[str, float] = {}
    print(f"\n{'layout':<9} {'predicted':>10} {'measured':>10} {'meas/pred':>9} {'median':>8} {'stock':>8} "
          f"  predicted parts | measured parts of the profiled step (s)")
    for name, lay in LAYOUTS.items():
        plan = make_plan(compose(site + common + lay))
        steps, failed = [], ""
        for k in range(args.runs):
            run = tmp / f"{name}-{k}"
            r = subprocess.run([sys.executable, "-m", "orchestrator", *site, *common, *lay, "launcher=local",
                                f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
            got = [float(x["step_time_s"]) for x in timed(read_steps(run))] if r.returncode == 0 else []
            steps += got[1:] or got  # the fastest step after each run's first: the least disturbed
            failed = failed or ("" if got else r.stderr[-200:])
        if not steps:
            print(f"{name:<9} {plan.step.wall_s:10.3f} {'failed':>10}   {failed}")
            continue
        med = step_stats(steps)["median_s"]
        meas = min(steps)
        os.environ["ORCHESTRATOR_CACHE_DIR"] = str(tmp / "no-cache")
        stock = make_plan(compose(["hardware=cpu"] + common + lay)).step.wall_s
        os.environ["ORCHESTRATOR_CACHE_DIR"] = str(tmp / "cache")
        parts = " ".join(f"{k} {v:.3f}" for k, v in plan.step.wall.items() if v > 0)
        prof = run / PROFILE_JSON
        profile = json.loads(prof.read_text()) if prof.exists() else None
        # the profiled step whole (its profiler overhead against the median), then its parts
        got = (f"step {profile['step_s']:.3f} ({profile['step_s'] / med:.2f}x the median): "
               + " ".join(f"{k} {v:.3f}" for k, v in profile["parts_s"].items() if v > 1e-4)) if profile else "-"
        ratios[name] = meas / plan.step.wall_s
        print(f"{name:<9} {plan.step.wall_s:10.3f} {meas:10.3f} {meas / plan.step.wall_s:9.2f} {med:8.3f} "
              f"{stock:8.3f}   {parts} | {got}", flush=True)
    inside = [k for k, r in ratios.items() if 0.8 <= r <= 1.2]
    print(f"\nwithin 20% of measured: {len(inside)} of {len(ratios)} layouts ({', '.join(inside)})")
    print(f"run directories under {tmp}")


if __name__ == "__main__":
    main()
