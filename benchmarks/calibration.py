"""Predicted vs published efficiency for every row of published/calibration.csv.

Prints, per row, the plan's predicted TFLOP/s and MFU (or HFU, in the metric the
source uses) next to the published ones, the kernel efficiency fitted per
hardware, and the mean absolute error. Run: .venv/bin/python benchmarks/calibration.py
"""
from __future__ import annotations

import argparse

from orchestrator.plan.calibrate import fit, load_rows, predict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--refit", action="store_true", help="fit the kernel efficiency here instead of the presets'")
    args = ap.parse_args()
    rows = load_rows()
    preds = predict(rows)
    fitted = fit(preds)
    if args.refit:
        preds = predict(rows, fitted)
    print(f"{'run':<52} {'metric':>6} {'layout':>22} {'fits':>5} {'pred':>7} {'publ':>7} {'err':>7} "
          f"{'TF/s pred':>9} {'TF/s publ':>9}")
    errs = []
    for p in preds:
        plan = p.plan
        lay = plan.layout.label() if plan.layout else "rejected"
        fits = ("yes" if plan.memory.fits else "NO") if plan.memory else "-"
        if p.predicted is None:
            print(f"{p.row.name[:52]:<52} {'':>6} {lay:>22} {fits:>5}   {plan.errors[0] if plan.errors else ''}")
            continue
        tf = p.predicted * plan.spec.hardware.peak_tflops
        if p.row.published is None:
            print(f"{p.row.name[:52]:<52} {p.row.metric.upper():>6} {lay:>22} {fits:>5} {p.predicted:7.1%} {'n/a':>7} "
                  f"{'':>7} {tf:9.0f} {'n/a':>9}")
            continue
        err = p.predicted - p.row.published
        errs.append(abs(err))
        print(f"{p.row.name[:52]:<52} {p.row.metric.upper():>6} {lay:>22} {fits:>5} {p.predicted:7.1%} "
              f"{p.row.published:7.1%} {100 * err:+6.1f}p {tf:9.0f} {p.row.tflops or 0:9.0f}")
    print(f"\nmean absolute error: {100 * sum(errs) / len(errs):.2f} points over {len(errs)} rows")
    print("kernel efficiency fitted on these rows (least squares): " +
          ", ".join(f"{k} {v:.3f}" for k, v in sorted(fitted.items())))


if __name__ == "__main__":
    main()
