"""Predicted vs published efficiency for every run of published/runs.csv, before and after.

Before: the planner's first model (one kernel efficiency per GPU type, this runtime's stack
for every run, Meta's fabric for every non-GPT run). After: stacks, fabrics, the shape-aware
kernel model (plan/kernels.py) fitted on the `use=fit` rows. Errors are MFU points in this
planner's convention (6N + causal attention, dense bf16 peak), the truth taken from each
run's printed throughput (plan/calibrate.py). Per source family: in-sample MAE and
leave-one-source-out MAE (refit without the family, predict it).

Run: .venv/bin/python benchmarks/calibration.py [--quick] [--presets]
  --quick    no leave-one-source-out folds
  --presets  use the fitted numbers in the presets instead of refitting
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.plan.calibrate import evaluate, load_runs  # noqa: E402


def _mae(preds) -> tuple[int, float | None, int]:
    errs = [abs(p.error) for p in preds if p.error is not None]
    return len(errs), (100 * sum(errs) / len(errs) if errs else None), sum(e <= 0.05 for e in errs)


def _fmt(x) -> str:
    return f"{x:5.1f}" if x is not None else "  n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the leave-one-source-out folds")
    ap.add_argument("--presets", action="store_true", help="the presets' fitted numbers, no refit")
    args = ap.parse_args()
    rows = load_runs()
    ev = evaluate(rows, refit=not args.presets, loso_folds=not args.quick)
    loso_after = {p.row.name: p for ps in ev.after_loso.values() for p in ps}
    loso_before = {p.row.name: p for ps in ev.before_loso.values() for p in ps}
    print(f"{'run':<58} {'family':<18} {'use':<4} {'layout':<26} {'true':>5} | {'before: shipped':>15} {'refit':>5} "
          f"{'LOSO':>5} | {'after':>5} {'LOSO':>5}   (MFU %, this planner's convention)")
    for a, b, sh in zip(ev.after, ev.before, ev.shipped):
        lay = a.plan.layout.label() if a.plan is not None and a.plan.layout else "-"
        la, lb = loso_after.get(a.row.name), loso_before.get(a.row.name)
        print(f"{a.row.name[:58]:<58} {a.row.family[:18]:<18} {a.row.use:<4} {lay[:26]:<26} "
              f"{_fmt(100 * a.truth if a.truth else None)} | {_fmt(100 * sh.predicted if sh.predicted else None):>15} "
              f"{_fmt(100 * b.predicted if b.predicted else None):>5} "
              f"{_fmt(100 * lb.predicted if lb and lb.predicted else None)} | "
              f"{_fmt(100 * a.predicted if a.predicted else None)} "
              f"{_fmt(100 * la.predicted if la and la.predicted else None)}")
    print("\nper source family: rows | before: as shipped, in-sample (refit), LOSO MAE | after: in-sample, LOSO MAE"
          " (MFU points)")
    fams = sorted({r.family for r in rows})
    tot = {k: [] for k in ("bs", "bi", "bl", "ai", "al")}
    for fam in fams:
        sel = lambda ps: [p for p in ps if p.row.family == fam]  # noqa: E731
        parts = {"bs": sel(ev.shipped), "bi": sel(ev.before), "bl": ev.before_loso.get(fam, []), "ai": sel(ev.after),
                 "al": ev.after_loso.get(fam, [])}
        for k, v in parts.items():
            tot[k] += [p for p in v if p.row.use == "fit"]
        n = len(sel(ev.after))
        use = {r.use for r in rows if r.family == fam}
        print(f"  {fam:<20} {n:>3} {'(eval only)' if use == {'eval'} else '':<11} | "
              f"{_fmt(_mae(parts['bs'])[1])} {_fmt(_mae(parts['bi'])[1])} {_fmt(_mae(parts['bl'])[1])} | "
              f"{_fmt(_mae(parts['ai'])[1])} "
              f"{_fmt(_mae(parts['al'])[1])}")
    print("  ---")
    for k, label in (("bs", "before, as shipped"), ("bi", "before, in sample"), ("bl", "before, leave one source out"),
                     ("ai", "after, in sample"), ("al", "after, leave one source out")):
        n, mae, within = _mae(tot[k])
        if n:
            print(f"  {label:<32} mean absolute error {mae:.2f} points over {n} fitted-source rows, "
                  f"{within} of {n} within 5 points")
    print("\nfitted: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.params.items()))
    print("first model's efficiency per GPU (least squares): " +
          ", ".join(f"{k} {v:.3f}" for k, v in sorted(ev.legacy_efficiency.items())))


if __name__ == "__main__":
    main()
