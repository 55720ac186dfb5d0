"""How far off the predicted MFU may be: an 80% interval from runs nobody fitted on.

benchmarks/calibration.py --write-intervals plans every published run (published/runs.csv)
with the kernel model refitted without the run's source family (leave one source family
out), takes the log residual log(true MFU / predicted MFU) of each, and writes their 10th
and 90th percentiles per group to `mfu_interval.json` beside this module. The planner only
reads that file (no calibration at plan time, no torch): a plan's interval is

    [MFU x exp(q10), MFU x exp(q90)]

of the first group with at least `min_rows` runs among: its stack and regime
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
    return mfu * math.exp(g["lo"]), mfu * math.exp(g["hi"]), key


def plan_interval(plan) -> tuple[float, float, str] | None:
    spec = plan.spec
    if spec.hardware.device.value == "cpu":
        return None
    if (spec.cost.kernel_model or spec.hardware.kernel_model).value == "constant":
        return None
    return interval(plan.mfu, spec.stack.name, regime(spec, plan.layout))


# ---- calibrating the table (benchmarks/calibration.py; never at plan time) ----------------------

def _quantile(xs: list[float], q: float) -> float:
    """The q-quantile at plotting position q (n + 1) (Weibull, Hyndman-Fan type 6): between
    the k-th and (n + 1 - k)-th of n residuals lies (n + 1 - 2k) / (n + 1) of new ones on
    average, so small groups get the wider interval they need."""
    xs = sorted(xs)
    pos = min(max(q * (len(xs) + 1) - 1.0, 0.0), len(xs) - 1.0)
    i = int(math.floor(pos))
    j = min(i + 1, len(xs) - 1)
    return xs[i] + (xs[j] - xs[i]) * (pos - i)


def residual(pred) -> tuple[str, str, float, str] | None:
    """(stack, regime, log(true / predicted MFU), source family) of one calibration Prediction."""
    if pred.predicted is None or pred.truth is None or pred.predicted <= 0 or pred.truth <= 0:
        return None
    spec = pred.plan.spec
    return spec.stack.name, regime(spec, pred.plan.layout), math.log(pred.truth / pred.predicted), pred.row.family


def build_table(preds, level: float = 0.8, min_rows: int = 8) -> dict:
    """Per group, the (1 - level) / 2 and (1 + level) / 2 quantiles of the log residuals. A
    group drawn from one source family only is kept out of the lookup (`rows` 0): one
    source's bias is not a stack's spread."""
    res = [r for r in map(residual, preds) if r is not None]
    keys: dict[str, list[float]] = {}
    fams: dict[str, set] = {}
    for stack, kind, r, fam in res:
        for key in (f"{stack}/{kind}", f"*/{kind}", f"{stack}/*", "*/*"):
            keys.setdefault(key, []).append(r)
            fams.setdefault(key, set()).add(fam)
    tail = (1.0 - level) / 2.0
    groups = {k: {"lo": round(_quantile(v, tail), 4), "hi": round(_quantile(v, 1.0 - tail), 4),
                  "rows": len(v) if len(fams[k]) > 1 else 0, "families": len(fams[k])}
              for k, v in sorted(keys.items())}
    return {"level": level, "min_rows": min_rows, "groups": groups}


def covered(pred, table: dict) -> bool | None:
    """Whether the run's true MFU lies inside the interval `table` gives its prediction."""
    r = residual(pred)
    if r is None:
        return None
    iv = interval(pred.predicted, r[0], r[1], table)
    return None if iv is None else iv[0] <= pred.truth <= iv[1]


def coverage(loso: dict, level: float = 0.8, min_rows: int = 8) -> dict[str, tuple[int, int, int, int]]:
    """Per source family: (inside the shipped interval, inside an interval calibrated without
    the family's own residuals, rows with an interval, rows). `loso`: family -> its
    leave-one-family-out Predictions."""
    every = [p for ps in loso.values() for p in ps]
    full = build_table(every, level, min_rows)
    out = {}
    for fam, preds in loso.items():
        nested = build_table([p for f, ps in loso.items() if f != fam for p in ps], level, min_rows)
        a = [covered(p, full) for p in preds]
        b = [covered(p, nested) for p in preds]
        out[fam] = (sum(x is True for x in a), sum(x is True for x in b), sum(x is not None for x in b), len(preds))
    return out
