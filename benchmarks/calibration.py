"""Predicted vs published efficiency for every run of published/runs.csv.

Each run is planned on its authors' stack and fabric with the shape-aware kernel model
(plan/kernels.py) fitted on the `use=fit` rows. Errors are MFU points in this
planner's convention (6N + causal attention, dense bf16 peak), the truth taken from each
run's printed throughput (orchestrator/published/calibrate.py). Per source family: in-sample MAE and
leave-one-source-out MAE (refit without the family, predict it).

Interval coverage (orchestrator/plan/uncertainty.py): per family, how often the run's true MFU
falls inside the 80% interval of its leave-one-source-out prediction, with the shipped table
(calibrated on every family's residuals) and with a table calibrated without the family's own
residuals (the honest figure: what a run from a new source can expect), both through the
planner's own plan_interval; per regime with and without the attention kernel's release term
(uncertainty.ATTENTION_BAND), with the intervals' mean width.

Run: .venv/bin/python benchmarks/calibration.py [--quick] [--presets] [--write-intervals]
  --quick            no leave-one-source-out folds (and no interval coverage)
  --presets          use the fitted numbers in the presets instead of refitting
  --write-intervals  write the interval table the planner reads (orchestrator/plan/mfu_interval.json)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from orchestrator.published.calibrate import evaluate, load_runs, time_shares  # noqa: E402
from orchestrator.plan.uncertainty import (ATTENTION_BAND, INTERVALS, by_regime, covered, honest,  # noqa: E402
                                           shipped_table)


def _mae(preds) -> tuple[int, float | None, int]:
    errs = [abs(p.error) for p in preds if p.error is not None]
    return len(errs), (100 * sum(errs) / len(errs) if errs else None), sum(e <= 0.05 for e in errs)


def _thr(preds) -> float | None:
    """Median |predicted / true throughput - 1| (%): MFU is throughput x FLOPs per token / peak, so
    their ratio is the throughput's."""
    import statistics

    errs = [abs(p.predicted / p.truth - 1) for p in preds if p.predicted and p.truth]
    return 100 * statistics.median(errs) if errs else None


def _fmt(x) -> str:
    return f"{x:5.1f}" if x is not None else "  n/a"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip the leave-one-source-out folds")
    ap.add_argument("--presets", action="store_true", help="the presets' fitted numbers, no refit")
    ap.add_argument("--write-intervals", action="store_true", help="write the planner's MFU interval table")
    args = ap.parse_args()
    if args.write_intervals and args.quick:
        ap.error("--write-intervals needs the leave-one-source-out folds: drop --quick")
    rows = load_runs()
    ev = evaluate(rows, refit=not args.presets, loso_folds=not args.quick)
    loso_after = {p.row.name: p for ps in ev.after_loso.values() for p in ps}
    print(f"{'run':<58} {'family':<18} {'use':<4} {'layout':<26} {'true':>5} | {'predicted':>9} {'LOSO':>5}"
          f"   (MFU %, this planner's convention)")
    for a in ev.after:
        lay = a.plan.layout.label() if a.plan is not None and a.plan.layout else "-"
        la = loso_after.get(a.row.name)
        print(f"{a.row.name[:58]:<58} {a.row.family[:18]:<18} {a.row.use:<4} {lay[:26]:<26} "
              f"{_fmt(100 * a.truth if a.truth else None)} | {_fmt(100 * a.predicted if a.predicted else None):>9} "
              f"{_fmt(100 * la.predicted if la and la.predicted else None)}")
    print("\nper source family: rows | in-sample MAE, leave-one-source-out MAE (MFU points) | median throughput "
          "error in sample, leave one source out (%)")
    fams = sorted({r.family for r in rows})
    tot = {k: [] for k in ("ai", "al")}
    for fam in fams:
        sel = lambda ps: [p for p in ps if p.row.family == fam]  # noqa: E731
        parts = {"ai": sel(ev.after), "al": ev.after_loso.get(fam, [])}
        for k, v in parts.items():
            tot[k] += [p for p in v if p.row.use == "fit"]
        n = len(sel(ev.after))
        use = {r.use for r in rows if r.family == fam}
        print(f"  {fam:<20} {n:>3} {'(eval only)' if use == {'eval'} else '':<11} | "
              f"{_fmt(_mae(parts['ai'])[1])} {_fmt(_mae(parts['al'])[1])} | {_fmt(_thr(parts['ai']))} "
              f"{_fmt(_thr(parts['al']))}")
    print("  ---")
    for k, label in (("ai", "in sample"), ("al", "leave one source out")):
        n, mae, within = _mae(tot[k])
        if n:
            print(f"  {label:<32} mean absolute error {mae:.2f} points over {n} fitted-source rows, "
                  f"{within} of {n} within 5 points, median throughput error {_thr(tot[k]):.1f}%")
    _systematic(ev)
    if ev.after_loso:
        _intervals(ev, args.write_intervals)
    print("\nfitted: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.params.items()))


def _systematic(ev) -> None:
    """What the misses share: per source family and per regime, the signed median throughput
    error (predicted / true - 1; leave one source out where the folds ran, else in sample) next
    to where the predicted step goes. A miss that grows with one part's share (err / share
    about constant across a family's rows) points at that part's physics."""
    import statistics

    from orchestrator.plan.uncertainty import regime

    preds = ([p for ps in ev.after_loso.values() for p in ps] if ev.after_loso else list(ev.after))
    preds = [p for p in preds if p.predicted and p.truth]
    parts = ("attention", "cp", "dp_exposed", "pp_bubble", "tp", "ep")
    print("\nsystematic residuals (" + ("leave one source out" if ev.after_loso else "in sample") +
          "): signed median throughput error (%) and median share of the predicted step (%) in "
          + ", ".join(parts) + "; err/attn: median error per unit attention share over rows with 30% or more")

    def line(label: str, ps) -> None:
        sh = [time_shares(p) for p in ps]
        err = [p.predicted / p.truth - 1 for p in ps]
        med = {k: 100 * statistics.median(s.get(k, 0.0) for s in sh) for k in parts}
        heavy = [e / s["attention"] for e, s in zip(err, sh) if s.get("attention", 0.0) >= 0.3]
        print(f"  {label:<24} {len(ps):>3} | {100 * statistics.median(err):+6.1f} | "
              + " ".join(f"{med[k]:5.1f}" for k in parts)
              + (f" | {statistics.median(heavy):+.2f} over {len(heavy)}" if heavy else ""))

    for fam in sorted({p.row.family for p in preds}):
        line(fam, [p for p in preds if p.row.family == fam])
    for reg in ("dense", "cp", "moe"):
        sel = [p for p in preds if regime(p.plan.spec, p.plan.layout) == reg]
        if sel:
            line("regime " + reg, sel)


def _intervals(ev, write: bool) -> None:
    import json

    table = shipped_table(ev.after_loso)
    judged = {u: honest(ev.after_loso, band=u) for u in ((0.0, 0.0), ATTENTION_BAND)}
    print("\n80% MFU interval coverage per source family (true MFU inside the interval of its leave-one-source-"
          "out prediction): shipped table | table without the family's own residuals")
    cov: dict[str, list[int]] = {}
    for p, iv in judged[ATTENTION_BAND]:
        acc = cov.setdefault(p.row.family, [0, 0, 0])
        acc[0] += covered(p, table) is True
        acc[1] += iv is not None and iv[0] <= p.truth <= iv[1]
        acc[2] += iv is not None
    tot = [sum(v[i] for v in cov.values()) for i in range(3)]
    for fam, (shipped, nested, n_iv) in sorted(cov.items()):
        print(f"  {fam:<20} {shipped:>3} of {n_iv:<3} | {nested:>3} of {n_iv:<3}")
    print(f"  {'all':<20} {tot[0]:>3} of {tot[2]:<3} | {tot[1]:>3} of {tot[2]:<3} "
          f"({100 * tot[0] / max(tot[2], 1):.0f}% | {100 * tot[1] / max(tot[2], 1):.0f}%)")
    print("  per regime, the honest figure and the intervals' mean width (high - low) / predicted MFU, without the "
          f"attention kernel's release term (band 0, 0) and with it (band {ATTENTION_BAND[0]:g}, {ATTENTION_BAND[1]:g}: "
          f"as long as FlashAttention-2 takes / the time cuDNN's saves against the fitted speed, the planner's):")
    for u, runs in judged.items():
        per = by_regime(runs)
        a, n = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
        print(f"    band {u[0]:g}, {u[1]:g}: " + ", ".join(f"{k} {i} of {m} ({100 * i / max(m, 1):.0f}%) width {w:.2f}"
                                         for k, (i, m, w) in per.items())
              + f"; all {a} of {n} ({100 * a / max(n, 1):.0f}%)")
    print(f"  quantile level for an 80% interval on unseen families: {table['quantile_level']:.2f} over every run; "
          "per regime " + ", ".join(f"{k} {v:.2f}" for k, v in table["quantile_levels"].items()))
    print("  groups (log residual quantiles, rows): " + ", ".join(
        f"{k} [{g['lo']:+.3f}, {g['hi']:+.3f}] {g['rows']}" for k, g in table["groups"].items()
        if g["rows"] >= table["min_rows"]))
    if write:
        INTERVALS.write_text(json.dumps(table, indent=1) + "\n")
        print(f"  wrote {INTERVALS}")


if __name__ == "__main__":
    main()
