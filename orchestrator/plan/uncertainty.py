"""How far off the predicted MFU may be: an 80% interval from runs nobody fitted on.

benchmarks/calibration.py --write-intervals plans every published run (published/runs.csv)
with the kernel model refitted without the run's source family (leave one source family
out), takes the log residual log(true MFU / predicted MFU) of each, and writes their
(1 - q) / 2 and (1 + q) / 2 quantiles per group, each source family weighing the same, to
`mfu_interval.json` beside this module, at the quantile level q that makes the interval cover
80% of the runs of families it was built without (calibrated_level: the 10-90% band of the
others' residuals covers fewer than 80% of a new family's runs, since each family carries its
own bias), one level per regime (calibrated_levels: context-parallel runs need a wider band than
dense ones; with one level over every run the regimes' honest coverage was cp 67%, dense 88%,
moe 80%, with one per regime 75%, 85%, 80%). The planner only
reads that file (no calibration at plan time, no torch): a plan's interval is

    [MFU x exp(q10), MFU x exp(q90)]

(a group of every regime, `stack/*` or `*/*`, at the plan's regime's level) of the first group
with at least `min_rows` runs among: its stack and regime
(`megatron_core/moe`), every stack in its regime (`*/moe`), its stack (`megatron_core/*`),
every run (`*/*`). The regime is `moe` (a model with experts), `cp` (context parallelism)
or `dense`. A stack with no published runs of its own (torchtitan, this runtime) borrows
every stack's spread, which the report says. Plans on `hardware=cpu` and plans of the
constant kernel model carry no interval: the residuals are GPU runs under the shape model.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

INTERVALS = Path(__file__).with_name("mfu_interval.json")


def regime(spec, layout) -> str:
    if spec.model.moe.experts:
        return "moe"
    return "cp" if layout.cp > 1 else "dense"


@lru_cache(maxsize=4)
def load(path: str = str(INTERVALS)) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def basis(table: dict, stack: str, kind: str) -> str | None:
    groups, need = table.get("groups", {}), table.get("min_rows", 8)
    for key in (f"{stack}/{kind}", f"*/{kind}", f"{stack}/*", "*/*"):
        g = groups.get(key)
        if g and g.get("rows", 0) >= need:
            return key
    return None


def interval(mfu: float, stack: str, kind: str, table: dict | None = None) -> tuple[float, float, str] | None:
    """(low, high, group) of the MFU's interval, or None where no group has enough runs."""
    table = load() if table is None else table
    key = basis(table, stack, kind)
    if key is None or not mfu or not math.isfinite(mfu):
        return None
    g = table["groups"][key]
    g = g.get("by_regime", {}).get(kind, g) if key.endswith("/*") else g  # the regime's own level
    return mfu * math.exp(g["lo"]), mfu * math.exp(g["hi"]), key


def plan_interval(plan) -> tuple[float, float, str] | None:
    spec = plan.spec
    if spec.hardware.device.value == "cpu":
        return None
    if (spec.cost.kernel_model or spec.hardware.kernel_model).value == "constant":
        return None
    return interval(plan.mfu, spec.stack.name, regime(spec, plan.layout))


# ---- calibrating the table (benchmarks/calibration.py; never at plan time) ----------------------

def _quantile(xs: list[float], fams: list[str], q: float) -> float:
    """The q-quantile with each source family weighing the same (its rows share one weight; each
    point at the middle of its weight): a new run comes from a new source, whose bias is one draw
    among the families', however many rows one family published."""
    count: dict[str, int] = {}
    for f in fams:
        count[f] = count.get(f, 0) + 1
    pts = sorted((x, 1.0 / count[f]) for x, f in zip(xs, fams))
    total = sum(w for _, w in pts)
    acc, pos = 0.0, []
    for x, w in pts:
        pos.append(((acc + w / 2.0) / total, x))
        acc += w
    if q <= pos[0][0]:
        return pos[0][1]
    for (p0, x0), (p1, x1) in zip(pos, pos[1:]):
        if q <= p1:
            return x0 + (x1 - x0) * (q - p0) / (p1 - p0)
    return pos[-1][1]


def residual(pred) -> tuple[str, str, float, str] | None:
    """(stack, regime, log(true / predicted MFU), source family) of one calibration Prediction."""
    if pred.predicted is None or pred.truth is None or pred.predicted <= 0 or pred.truth <= 0:
        return None
    spec = pred.plan.spec
    return spec.stack.name, regime(spec, pred.plan.layout), math.log(pred.truth / pred.predicted), pred.row.family


def build_table(preds, level: float = 0.8, min_rows: int = 8, levels: dict[str, float] | None = None) -> dict:
    """Per group, the (1 - level) / 2 and (1 + level) / 2 quantiles of the log residuals, each
    source family weighing the same (_quantile). `levels` (regime -> quantile level) sets the
    level of each regime's groups (`stack/cp`, `*/cp`); a group of every regime (`stack/*`,
    `*/*`) is at `level` and, as a regime's fallback, at that regime's level too (`by_regime`).
    A group drawn from one source family only is kept out of the lookup (`rows` 0): one
    source's bias is not a stack's spread."""
    levels = levels or {}
    res = [r for r in map(residual, preds) if r is not None]
    keys: dict[str, list[float]] = {}
    fams: dict[str, set] = {}
    owner: dict[str, list[str]] = {}
    for stack, kind, r, fam in res:
        for key in (f"{stack}/{kind}", f"*/{kind}", f"{stack}/*", "*/*"):
            keys.setdefault(key, []).append(r)
            fams.setdefault(key, set()).add(fam)
            owner.setdefault(key, []).append(fam)

    def band(v: list[float], who: list[str], q: float) -> dict:
        tail = (1.0 - q) / 2.0
        return {"lo": round(_quantile(v, who, tail), 4), "hi": round(_quantile(v, who, 1.0 - tail), 4)}

    groups = {}
    for k, v in sorted(keys.items()):
        kind = k.split("/", 1)[1]
        g = {**band(v, owner[k], levels.get(kind, level)), "rows": len(v) if len(fams[k]) > 1 else 0,
             "families": len(fams[k])}
        if kind == "*" and levels:
            g["by_regime"] = {r: band(v, owner[k], q) for r, q in sorted(levels.items())}
        groups[k] = g
    return {"level": level, "min_rows": min_rows, "groups": groups}


def covered(pred, table: dict) -> bool | None:
    """Whether the run's true MFU lies inside the interval `table` gives its prediction."""
    r = residual(pred)
    if r is None:
        return None
    iv = interval(pred.predicted, r[0], r[1], table)
    return None if iv is None else iv[0] <= pred.truth <= iv[1]


# Quantile levels tried for the 80% interval: leaving a family out removes its bias from the
# residuals, so the residuals' own 10-90% band covers fewer of a new family's runs than 80%.
LEVELS = tuple(round(0.80 + 0.01 * i, 2) for i in range(17))


def _nested(loso: dict, level: float, min_rows: int) -> dict[str, tuple[int, int]]:
    """Per regime, (inside, rows with an interval): each family judged by a table built without it."""
    out: dict[str, list[int]] = {}
    for fam, preds in loso.items():
        table = build_table([p for f, ps in loso.items() if f != fam for p in ps], level, min_rows)
        for p in preds:
            c, r = covered(p, table), residual(p)
            if c is not None:
                acc = out.setdefault(r[1], [0, 0])
                acc[0] += c
                acc[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _levels(loso: dict, target: float, min_rows: int) -> tuple[float, dict[str, float]]:
    """calibrated_level and calibrated_levels in one pass over LEVELS (their nested tables are the same)."""
    kinds = sorted({r[1] for ps in loso.values() for p in ps if (r := residual(p)) is not None})
    overall, found = None, {}
    for level in LEVELS:
        per = _nested(loso, level, min_rows)
        inside, rows = sum(a for a, _ in per.values()), sum(n for _, n in per.values())
        if overall is None and rows and inside / rows >= target:
            overall = level
        for kind, (a, n) in per.items():
            if kind not in found and n and a / n >= target:
                found[kind] = level
        if overall is not None and len(found) == len(kinds):
            break
    return overall or LEVELS[-1], {k: found.get(k, LEVELS[-1]) for k in kinds}


def calibrated_level(loso: dict, target: float = 0.8, min_rows: int = 8) -> float:
    """The lowest quantile level (LEVELS) whose intervals, each family's built without that family's
    residuals, cover `target` of the families' runs: the level a table needs to cover `target`
    of a source it has never seen (conformal-style, over families rather than rows)."""
    return _levels(loso, target, min_rows)[0]


def calibrated_levels(loso: dict, target: float = 0.8, min_rows: int = 8) -> dict[str, float]:
    """calibrated_level per regime: the lowest level whose intervals cover `target` of that
    regime's runs, each family's built without it. Regimes differ in how far a new source's
    bias reaches (context-parallel runs: attention kernels and rings each stack runs its own
    way), so one level over every run covers some regimes by over-covering others. A run's
    interval depends on its own regime's level only, so the levels are found together."""
    return _levels(loso, target, min_rows)[1]


def _table(loso: dict, target: float, min_rows: int) -> dict:
    """The table calibrated on `loso`'s families: every residual, each regime at its own level."""
    level, levels = _levels(loso, target, min_rows)
    table = build_table([p for ps in loso.values() for p in ps], level, min_rows, levels)
    return {**table, "quantile_level": level, "quantile_levels": levels}


def shipped_table(loso: dict, target: float = 0.8, min_rows: int = 8) -> dict:
    """The table the planner reads: every family's residuals at the levels calibrated_levels finds."""
    return {**_table(loso, target, min_rows), "level": target}


def coverage(loso: dict, target: float = 0.8, min_rows: int = 8) -> dict[str, tuple[int, int, int, int]]:
    """Per source family: (inside the shipped interval, inside an interval calibrated without
    the family's own residuals, its levels chosen without them too, rows with an interval, rows).
    `loso`: family -> its leave-one-family-out Predictions."""
    full = shipped_table(loso, target, min_rows)
    out = {}
    for fam, preds in loso.items():
        others = {f: ps for f, ps in loso.items() if f != fam}
        nested = _table(others, target, min_rows)  # its levels chosen without the family too
        a = [covered(p, full) for p in preds]
        b = [covered(p, nested) for p in preds]
        out[fam] = (sum(x is True for x in a), sum(x is True for x in b), sum(x is not None for x in b), len(preds))
    return out


def coverage_by_regime(loso: dict, target: float = 0.8, min_rows: int = 8) -> dict[str, tuple[int, int]]:
    """Per regime (dense, cp, moe): (inside, rows with an interval) of the honest figure, each
    family's runs judged by a table (and levels) built without that family."""
    out: dict[str, list[int]] = {}
    for fam, preds in loso.items():
        others = {f: ps for f, ps in loso.items() if f != fam}
        nested = _table(others, target, min_rows)  # its levels chosen without the family too
        for p in preds:
            c, r = covered(p, nested), residual(p)
            if c is not None and r is not None:
                acc = out.setdefault(r[1], [0, 0])
                acc[0] += c
                acc[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}
