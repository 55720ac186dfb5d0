"""How far off the predicted MFU may be: an 80% interval from runs nobody fitted on.

A plan's interval is

    [MFU x exp(lo) / (1 + a x u),  MFU x exp(hi)]

- The attention kernel's release, at both ends. `a` is the share of the predicted step the
  attention kernel takes (attention_share: the pacing stage's flash-attention time per micro-batch,
  plan/kernels.py at the fitted attention speed, times the micro-batches, over the predicted step;
  `attention_share` in plan.json). The step model fits one attention speed for every stack and
  release (plan/kernels.py), about 500 TFLOP/s forward on an H100 (0.50 of the bf16 peak); the
  published kernels at head dim 128 run from FlashAttention-2's 370 to cuDNN's 595 TFLOP/s forward
  (Shah et al. 2024, arXiv:2407.08608; Transformer Engine's own H100 benchmark puts 20-50% between
  them, docs/examples/attention/attention.ipynb, 2024-06). A release's kernel may take up to
  `slow` = speed / 370 - 1 more of its time (0.35) or save `fast` = 1 - speed / 595 of it (0.16):
  the interval is [MFU exp(lo) / (1 + a slow), MFU exp(hi) / (1 - a fast)] (ATTENTION_BAND, from
  the schema's fitted speed and the sources' figures, fitted on no run). Until 2026-12-05 the fitted
  speed was 0.63 of the peak, past cuDNN's, and the term was the low end's alone at 1.5x (the top of
  that 20-50%); with the refit (torchtitan's context-parallel runs in the fit) that term covered 90
  of 114 runs honestly, the band at both ends 95. Without flash attention (the scores as GEMMs) or
  with little attention (a = 0.02 in the median dense run, 0.13 MoE, 0.5 CP) it barely moves.
- The rest, (lo, hi): quantiles of the log residuals log(true MFU / predicted MFU) of every
  published run (published/runs.csv), each planned with the kernel model refitted without its
  source family (leave one source family out), each source family weighing the same (_quantile),
  per group (below), at the quantile level q ((1 - q) / 2 and (1 + q) / 2) that makes the
  interval, release term included, cover 80% of the runs of families it was built without
  (calibrated_level; one per regime, calibrated_levels: 0.80 in each since the release term). The
  residuals stay as they are: taking the release term out of them, so that a run slower than
  predicted by what a slower kernel explains counts as on time, credits every slow run with a
  moderate attention share to the kernel and narrows the band the runs with little attention
  need (honest coverage, per row: cp 8 of 12, dense 53 of 68, moe 7 of 10; with one slowdown per
  family by least squares: 11, 55, 7 of those). Left in, a family whose slowness is the kernel
  (NeMo long-context) also widens the low end of the cp groups it is in, which the calibrated
  level (the lowest tried) says is not more than the other families need.

benchmarks/calibration.py --write-intervals writes the table to `mfu_interval.json` beside this
module, with the `attention_band` it was calibrated with, which the interval uses. The planner
only reads that file (no calibration at plan time, no torch). The honest evaluation (`honest`:
benchmarks/calibration.py, tests/test_fidelity.py) judges each run with plan_interval, the
planner's own function, under a table and levels built without the run's family.

Honest coverage and mean width (high - low) / MFU of those intervals, on 90 runs of 11 families
(2026-12-05, before the 24 evaluation runs of the FSDP2 families joined: with them, 114 runs, u = 0.5:
cp 13 of 15, dense 72 of 89, moe 8 of 10, all 93 of 114, 82%), without the release
term (u = 0, the table before) -> with it (u = 0.5):
cp 4 of 12 (33%), width 0.25 -> 10 of 12 (83%), 0.40; dense 58 of 68 (85%), 0.26 -> 57 of 68
(84%), 0.26; moe 8 of 10 (80%), 0.33 -> 8 of 10 (80%), 0.38; all 70 of 90 (78%) -> 75 of 90 (83%).
Without it, the evaluation-only NeMo 24.03.01 long-context family (attention 40-97% of the
predicted step, ~30% slower than predicted, the same ~0.38 of its attention time on every run)
was judged by a cp band of 5 runs of other families and 1 of its 7 runs was inside; now 7 of 7.
The shipped intervals of the recipes: llama3_405b width 0.24 -> 0.25, llama3_405b_long_context
0.32 -> 0.43 (a = 0.40), deepseek_v3 0.28 -> 0.33 (a = 0.13).
After the refit (attention 0.63 -> 0.50 of the peak) and the band at both ends: cp 15 of 15 (width
0.55), dense 72 of 89 (0.23), moe 8 of 10 (0.29), all 95 of 114 (83%); without the term 91 of 114.

The group is the first with at least `min_rows` runs among: the plan's stack and regime
(`megatron_core/moe`), every stack in its regime (`*/moe`), its stack (`megatron_core/*`),
every run (`*/*`); a group of every regime (`stack/*`, `*/*`) at the plan's regime's level.
The regime is `moe` (a model with experts), `cp` (context parallelism) or `dense`. A stack with
no published runs of its own (torchtitan, this runtime) borrows every stack's spread, which the
report says. Plans on `hardware=cpu` and plans of the constant kernel model carry no interval:
the residuals are GPU runs under the shape model.
"""
from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path

INTERVALS = Path(__file__).with_name("mfu_interval.json")

# The attention kernel's speed by release, as published (H100, bf16, head dim 128, forward, 16K
# tokens; Shah et al. 2024, arXiv:2407.08608): FlashAttention-2 370 TFLOP/s, cuDNN's fused attention
# 595, against the H100's dense bf16 peak. Sources' figures, never fitted.
H100_BF16_PEAK_TFLOPS = 989.0
FA2_FORWARD_TFLOPS = 370.0
FUSED_FORWARD_TFLOPS = 595.0


def attention_band(efficiency: float) -> tuple[float, float]:
    """(slow, fast) of the attention kernel's release term for a fitted attention speed
    (cost.attention_efficiency, a fraction of the bf16 peak): how much longer the slowest
    published kernel takes than the fitted speed (FlashAttention-2: speed / 370 - 1), and the share
    of its time the fastest saves (cuDNN: 1 - speed / 595); 0 where the fitted speed is past one."""
    speed = efficiency * H100_BF16_PEAK_TFLOPS
    return (round(max(speed / FA2_FORWARD_TFLOPS - 1.0, 0.0), 4),
            round(max(1.0 - speed / FUSED_FORWARD_TFLOPS, 0.0), 4))


def _fitted_band() -> tuple[float, float]:
    from orchestrator.config.schema import CostConfig

    return attention_band(CostConfig().attention_efficiency)


# The band at the shipped fit (the schema's cost.attention_efficiency): what mfu_interval.json is
# calibrated with and every plan's interval uses.
ATTENTION_BAND = _fitted_band()


def regime(spec, layout) -> str:
    if spec.model.moe.experts:
        return "moe"
    return "cp" if layout.cp > 1 else "dense"


def attention_share(plan, stages, mm) -> float:
    """The share of the predicted step its attention kernel takes: the flash-attention time of
    one micro-batch on the pacing stage (plan/kernels.py, at the fitted attention speed) times the
    micro-batches, over the predicted step. 0 without a step or under the constant kernel model;
    without flash attention the kernel model counts the scores as GEMMs, not attention."""
    step, spec, d = plan.step, plan.spec, plan.layout
    if step is None or not step.wall_s or not stages or _constant(spec):
        return 0.0
    from orchestrator.plan.kernels import coefficients, shape_of, stage_features

    coef = coefficients(spec.hardware, spec.cost)
    feats = stage_features(stages[min(step.stage, len(stages) - 1)], mm,
                           shape_of(d, spec.training, spec.hardware, spec, coef))
    return d.microbatches * feats.attn / coef.attention_efficiency / step.wall_s


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


def interval(mfu: float, stack: str, kind: str, table: dict | None = None,
             attention: float = 0.0) -> tuple[float, float, str] | None:
    """(low, high, group) of the MFU's interval, or None where no group has enough runs;
    `attention`: the plan's attention_share (the release term at both ends, at the table's band)."""
    table = load() if table is None else table
    key = basis(table, stack, kind)
    if key is None or not mfu or not math.isfinite(mfu):
        return None
    g = table["groups"][key]
    g = g.get("by_regime", {}).get(kind, g) if key.endswith("/*") else g  # the regime's own level
    slow, fast = table.get("attention_band") or (0.0, 0.0)
    a = max(attention, 0.0)
    return mfu * math.exp(g["lo"]) / (1.0 + a * slow), mfu * math.exp(g["hi"]) / max(1.0 - a * fast, 1e-9), key


def plan_interval(plan, table: dict | None = None) -> tuple[float, float, str] | None:
    """The plan's interval (None on hardware=cpu and under the constant kernel model); `table`:
    the shipped one unless given (the honest evaluation passes one built without the run's family)."""
    spec = plan.spec
    if spec.hardware.device.value == "cpu" or _constant(spec):
        return None
    return interval(plan.mfu, spec.stack.name, regime(spec, plan.layout), table, plan.attention_share or 0.0)


def _constant(spec) -> bool:
    return (spec.cost.kernel_model or spec.hardware.kernel_model).value == "constant"


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


def build_table(preds, level: float = 0.8, min_rows: int = 8, levels: dict[str, float] | None = None,
                band: tuple = ATTENTION_BAND) -> dict:
    """Per group, the (1 - level) / 2 and (1 + level) / 2 quantiles of the log residuals as they
    are (the attention release term is not taken out of them: module docstring), each source
    family weighing the same (_quantile); `band` is the release term's (slow, fast) the table goes with. `levels` (regime -> quantile level) sets the level of each regime's groups
    (`stack/cp`, `*/cp`); a group of every regime (`stack/*`, `*/*`) is at `level` and, as a
    regime's fallback, at that regime's level too (`by_regime`). A group drawn from one source
    family only is kept out of the lookup (`rows` 0): one source's bias is not a stack's spread."""
    levels = levels or {}
    keys: dict[str, list[float]] = {}
    fams: dict[str, set] = {}
    owner: dict[str, list[str]] = {}
    for stack, kind, r, fam in filter(None, map(residual, preds)):
        for key in (f"{stack}/{kind}", f"*/{kind}", f"{stack}/*", "*/*"):
            keys.setdefault(key, []).append(r)
            fams.setdefault(key, set()).add(fam)
            owner.setdefault(key, []).append(fam)

    def bounds(v: list[float], who: list[str], q: float) -> dict:
        tail = (1.0 - q) / 2.0
        return {"lo": round(_quantile(v, who, tail), 4), "hi": round(_quantile(v, who, 1.0 - tail), 4)}

    groups = {}
    for k, v in sorted(keys.items()):
        kind = k.split("/", 1)[1]
        g = {**bounds(v, owner[k], levels.get(kind, level)), "rows": len(v) if len(fams[k]) > 1 else 0,
             "families": len(fams[k])}
        if kind == "*" and levels:
            g["by_regime"] = {r: bounds(v, owner[k], q) for r, q in sorted(levels.items())}
        groups[k] = g
    return {"level": level, "min_rows": min_rows, "attention_band": list(band), "groups": groups}


def covered(pred, table: dict) -> bool | None:
    """Whether the run's true MFU lies inside the interval the planner (plan_interval) gives its
    plan under `table`."""
    if residual(pred) is None:
        return None
    iv = plan_interval(pred.plan, table)
    return None if iv is None else iv[0] <= pred.truth <= iv[1]


# Quantile levels tried for the 80% interval: leaving a family out removes its bias from the
# residuals, so the residuals' own 10-90% band covers fewer of a new family's runs than 80%.
LEVELS = tuple(round(0.80 + 0.01 * i, 2) for i in range(17))


def _nested(loso: dict, level: float, min_rows: int, band: tuple) -> dict[str, tuple[int, int]]:
    """Per regime, (inside, rows with an interval): each family judged by a table built without it."""
    out: dict[str, list[int]] = {}
    for fam, preds in loso.items():
        table = build_table([p for f, ps in loso.items() if f != fam for p in ps], level, min_rows, band=band)
        for p in preds:
            c, r = covered(p, table), residual(p)
            if c is not None:
                acc = out.setdefault(r[1], [0, 0])
                acc[0] += c
                acc[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _levels(loso: dict, target: float, min_rows: int, band: tuple) -> tuple[float, dict[str, float]]:
    """calibrated_level and calibrated_levels in one pass over LEVELS (their nested tables are the same)."""
    kinds = sorted({r[1] for ps in loso.values() for p in ps if (r := residual(p)) is not None})
    overall, found = None, {}
    for level in LEVELS:
        per = _nested(loso, level, min_rows, band)
        inside, rows = sum(a for a, _ in per.values()), sum(n for _, n in per.values())
        if overall is None and rows and inside / rows >= target:
            overall = level
        for kind, (a, n) in per.items():
            if kind not in found and n and a / n >= target:
                found[kind] = level
        if overall is not None and len(found) == len(kinds):
            break
    return overall or LEVELS[-1], {k: found.get(k, LEVELS[-1]) for k in kinds}


def calibrated_level(loso: dict, target: float = 0.8, min_rows: int = 8, band: tuple = ATTENTION_BAND) -> float:
    """The lowest quantile level (LEVELS) whose intervals, each family's built without that family's
    residuals, cover `target` of the families' runs: the level a table needs to cover `target`
    of a source it has never seen (conformal-style, over families rather than rows)."""
    return _levels(loso, target, min_rows, band)[0]


def calibrated_levels(loso: dict, target: float = 0.8, min_rows: int = 8,
                      band: tuple = ATTENTION_BAND) -> dict[str, float]:
    """calibrated_level per regime: the lowest level whose intervals cover `target` of that
    regime's runs, each family's built without it. Regimes differ in how far a new source's
    bias reaches, so one level over every run covers some regimes by over-covering others. A
    run's interval depends on its own regime's level only, so the levels are found together."""
    return _levels(loso, target, min_rows, band)[1]


def _table(loso: dict, target: float, min_rows: int, band: tuple) -> dict:
    """The table calibrated on `loso`'s families: every residual, each regime at its own level."""
    level, levels = _levels(loso, target, min_rows, band)
    table = build_table([p for ps in loso.values() for p in ps], level, min_rows, levels, band)
    return {**table, "quantile_level": level, "quantile_levels": levels}


def shipped_table(loso: dict, target: float = 0.8, min_rows: int = 8, band: tuple = ATTENTION_BAND) -> dict:
    """The table the planner reads: every family's residuals at the levels calibrated_levels finds."""
    return {**_table(loso, target, min_rows, band), "level": target}


def honest(loso: dict, target: float = 0.8, min_rows: int = 8,
           band: tuple = ATTENTION_BAND) -> list[tuple[object, tuple[float, float, str] | None]]:
    """Every run with the planner's interval (plan_interval) under a table calibrated without its
    family's residuals, the levels chosen without them too: what a run from a new source can
    expect. `loso`: family -> its leave-one-family-out Predictions."""
    out = []
    for fam, preds in loso.items():
        nested = _table({f: ps for f, ps in loso.items() if f != fam}, target, min_rows, band)
        out += [(p, plan_interval(p.plan, nested) if residual(p) is not None else None) for p in preds]
    return out


def by_regime(judged) -> dict[str, tuple[int, int, float]]:
    """Per regime (cp, dense, moe) of `honest`'s runs with an interval: (inside, rows, the
    intervals' mean width (high - low) / predicted MFU)."""
    out: dict[str, list[float]] = {}
    for p, iv in judged:
        if iv is not None:
            acc = out.setdefault(residual(p)[1], [0, 0, 0.0])
            acc[0] += iv[0] <= p.truth <= iv[1]
            acc[1] += 1
            acc[2] += (iv[1] - iv[0]) / p.predicted
    return {k: (int(v[0]), int(v[1]), v[2] / v[1]) for k, v in sorted(out.items())}
