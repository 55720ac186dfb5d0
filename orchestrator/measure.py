"""Measured feeds back: compare finished runs with their plans and refit the efficiency.

    orchestrate-calibrate outputs/2026-11-29/10-00-00 [more run dirs] [--write conf/hardware/site.yaml]

Each run directory holds the `plan.json` the run was launched with and its measured
step times (`metrics.json`, written by the runtime, or the TensorBoard scalar
`time/step_s`). The measured MFU is the plan's model FLOPs per step over
(world x peak x measured step time); the refit kernel efficiency is the least-squares
scale from the plan's useful fraction to the measured MFU (plan/calibrate.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from orchestrator.plan.calibrate import fit_measured
from orchestrator.plan.metrics import measured_mfu


@dataclass
class Measured:
    run: Path
    hardware: str
    predicted_step_s: float
    measured_step_s: float
    predicted_mfu: float
    measured_mfu: float
    useful_fraction: float  # predicted MFU at kernel efficiency 1


def measured_step_time(run: Path, skip_first: int = 1) -> float:
    """Median measured step time (the first steps include warm-up)."""
    m = run / "metrics.json"
    if m.exists():
        steps = json.loads(m.read_text())["step_time_s"]
    else:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(run / "tensorboard")).Reload()
        steps = [e.value for e in acc.Scalars("time/step_s")]
    steps = steps[skip_first:] or steps
    if not steps:
        raise ValueError(f"{run}: no measured step times")
    return statistics.median(steps)


def read_run(run: Path) -> Measured:
    plan = json.loads((run / "plan.json").read_text())
    hw = plan["config"]["hardware"]
    step = measured_step_time(run)
    return Measured(run, hw["name"], plan["step"]["wall_s"], step, plan["mfu"], measured_mfu(plan, step),
                    plan["mfu"] / hw["kernel_efficiency"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orchestrate-calibrate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (plan.json + metrics)")
    ap.add_argument("--write", type=Path, help="write a hardware preset with the refit efficiency here")
    args = ap.parse_args(argv)
    rows = []
    for run in args.runs:
        try:
            rows.append(read_run(run))
        except (OSError, KeyError, ValueError) as e:
            print(f"error: {run}: {e}", file=sys.stderr)
            return 2
    names = {r.hardware for r in rows}
    if len(names) != 1:
        print(f"error: runs on different hardware {sorted(names)}; calibrate one preset at a time", file=sys.stderr)
        return 2
    print(f"{'run':<48} {'pred step':>10} {'meas step':>10} {'pred MFU':>9} {'meas MFU':>9}")
    for r in rows:
        print(f"{str(r.run)[-48:]:<48} {r.predicted_step_s:10.4f} {r.measured_step_s:10.4f} "
              f"{r.predicted_mfu:9.2%} {r.measured_mfu:9.2%}")
    eff = fit_measured([(r.useful_fraction, r.measured_mfu) for r in rows])
    print(f"refit kernel_efficiency for {names.pop()}: {eff:.4f}")
    if args.write:
        plan = json.loads((rows[0].run / "plan.json").read_text())
        hw = dict(plan["config"]["hardware"], kernel_efficiency=round(eff, 4))
        from omegaconf import OmegaConf

        args.write.write_text("# refit by orchestrate-calibrate from measured runs\n" + OmegaConf.to_yaml(hw))
        print(f"wrote {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
