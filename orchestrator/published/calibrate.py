"""Calibration against published runs, and refitting from a site's own runs.

Every published run in `published/runs.csv` (calibration.csv's rows and the ones found
since, each with its source and a `family` per source) is planned from its own columns
by fixed rules: the stack and fabric its authors used, the model's shape, the layout,
the precision, and recompute as stated (or the least that fits where it is not stated,
since the run ran). No per-row constants.

The truth of a row is its throughput, from whatever the source prints: tokens per second,
the iteration time, or TFLOP/s / MFU / HFU in the source's own FLOP convention (Megatron
2021's HFU, Megatron's and MegaScale's MFU, Megatron-Core r0.8.0's and NeMo 24.07's
non-causal counts; each checked against a row that prints two of them). Errors are in MFU
points in this planner's convention (6N + causal attention, against the dense bf16 peak),
so every source is judged on the same scale.

The shape-aware kernel model (plan/kernels.py) has seven fitted numbers: the GEMM ceiling
of each GPU generation (Ampere, Hopper, Blackwell) and four shared by every GPU. They are
fitted by Levenberg-Marquardt on the MFU residuals of the `use=fit` rows, each step
re-planning the rows (the step's overlaps depend on the compute time, so the fit goes
through the planner, not around it). `loso` refits without one source family and predicts
it: the error that says how the planner does on runs nobody fitted on.

The CSVs are found where `config.paths.PUBLISHED_DIR` says: `published/` at the top of a
checkout, inside the package (`orchestrator/published/`) in an installed wheel.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.config.paths import PUBLISHED_DIR
from orchestrator.plan.validate import uneven_split

RUNS_CSV = PUBLISHED_DIR / "runs.csv"
CALIBRATION_CSV = PUBLISHED_DIR / "calibration.csv"
GENERATION = {"a100_80gb": "ampere", "h100_sxm": "hopper", "h800": "hopper", "h200": "hopper",
              "b200": "blackwell", "gb200": "blackwell", "gb300": "blackwell"}
SHARED = ("elementwise", "attention_efficiency", "fp8_gemm_efficiency", "launch_overhead_us")
PARAMS = tuple(f"gemm_efficiency:{g}" for g in ("ampere", "hopper", "blackwell")) + SHARED


@dataclass
class Row:
    name: str
    source: str
    family: str
    use: str  # fit | eval
    hardware: str
    overrides: list[str]
    published: float | None  # the printed figure, as a fraction (MFU, HFU, or TFLOP/s / peak)
    metric: str  # what `published` is: mfu | hfu | tflops
    tflops: float | None
    truth: str  # which printed figure gives the throughput, and in whose FLOP convention
    gpus: int
    tokens: int  # per step
    recompute: str  # none | selective | full | least (not stated: the least that fits)
    raw: dict = field(repr=False, default_factory=dict)
    note: str = ""


def _int(x: str, default: int | None = None) -> int | None:
    m = re.match(r"\s*(\d+)", x or "")
    return int(m.group(1)) if m else default


def _float(x: str) -> float | None:
    m = re.match(r"\s*([0-9.]+)", x or "")
    return float(m.group(1)) if m else None


def load_runs(path: Path = RUNS_CSV) -> list[Row]:
    with open(path, newline="") as f:
        return [row_from_csv(r) for r in csv.DictReader(f)]


def load_rows(path: Path = CALIBRATION_CSV) -> list[Row]:
    """The rows of `path` (calibration.csv by default), planned as runs.csv describes them."""
    with open(path, newline="") as f:
        names = [r["name"] for r in csv.DictReader(f)]
    runs = {r.name: r for r in load_runs()}
    return [runs[n] for n in names if n in runs]


def _vp(r: dict, layers: int, pp: int, split: list[int] | None) -> int:
    v = _int(r.get("vp") or r.get("VP") or "")
    if v:
        return v
    sched = r["schedule"].lower()
    if pp > 1 and ("interleaved" in sched or "not stated" in sched):
        # The sources do not print V: one layer per chunk on the smallest stage, at most 8.
        smallest = min(split) if split else layers // pp
        return max(x for x in range(1, min(smallest, 8) + 1) if split or (layers // pp) % x == 0)
    return 1


def row_from_csv(r: dict) -> Row:
    hw = r["hardware"]
    gpus = _int(r["gpu_count"])
    tp, cp, pp = _int(r["TP"], 1), _int(r["CP"], 1), _int(r["PP"], 1)
    dp, ep = _int(r["DP"], 1), _int(r["EP"], 1)
    layers, seq, gbs = _int(r["layers"]), _int(r["seq_len"]), _int(r["global_batch_seqs"])
    mbs = _int(r["mbs"], 1)
    o = [f"hardware={hw}", f"stack={r['stack']}", f"fabric={r['fabric']}", f"training.seq_len={seq}",
         f"training.global_batch={gbs}", f"training.micro_batch={mbs}", f"layout.tp={tp}", f"layout.cp={cp}",
         f"layout.pp={pp}", f"layout.dp={dp}", f"layout.ep={ep}", f"layout.zero={_int(r['zero'], 1)}",
         f"training.flash_attention={'true' if r['flash'] == 'y' else 'false'}",
         f"layout.sequence_parallel={'true' if r['sp'] == 'y' else 'false'}"]
    gpn = {"gb200": 4, "gb300": 4}.get(hw, 8)
    o.append(f"cluster.nodes={gpus // gpn}")
    if r["model_preset"]:
        o.append(f"model={r['model_preset']}")
    else:
        o += ["model=llama3_8b", f"model.name={re.sub(r'[^A-Za-z0-9_.]+', '_', r['name'])[:60]}",
              f"model.layers={layers}", f"model.hidden={_int(r['hidden'])}", f"model.heads={_int(r['attn_heads'])}",
              f"model.kv_heads={_int(r['kv_heads'])}", f"model.vocab={_int(r['vocab'])}", f"model.mlp={r['mlp']}",
              f"model.tied_embeddings={'true' if r['tied'] == 'y' else 'false'}",
              f"model.dropout={'true' if r['dropout'] == 'y' else 'false'}"]
        if r["head_dim"]:
            o.append(f"model.head_dim={_int(r['head_dim'])}")
        if r["moe"]:
            m = re.match(r"(\d+)x(\d+) top(\d+) shared(\d+) dense(\d+)", r["moe"])
            experts, ffn, k, shared, dense = (int(x) for x in m.groups())
            o += [f"model.ffn_hidden={ffn}", f"model.moe.experts={experts}", f"model.moe.expert_ffn_hidden={ffn}",
                  f"model.moe.experts_per_token={k}", f"model.moe.shared_experts={shared}",
                  f"model.moe.dense_layers={dense}"]
        else:
            o.append(f"model.ffn_hidden={_int(r['ffn_hidden'])}")
    moe = bool(r["moe"] or r["model_preset"] == "deepseek_v3")
    if moe:
        o += ["layout.etp=1", f"model.moe.load_imbalance={_float(r['imbalance']) or 0.0}",
              f"model.moe.max_nodes_per_token={_int(r['max_nodes'], 0)}"]
    if r["recompute"] != "least":
        o.append(f"training.recompute={r['recompute']}")
    if _int(r.get("mtp", "")):
        o.append(f"training.mtp_depth={_int(r['mtp'])}")
    fp8 = "fp8" in r["precision"].lower()
    o.append(f"training.precision={'fp8' if fp8 else 'bf16'}")
    if r["model_preset"] == "deepseek_v3" and r["family"] == "deepseek_v3":
        o.append("training.optimizer_bytes=8")
    if r["nvlink_domain"]:
        o.append(f"fabric.nvlink_domain={_int(r['nvlink_domain'])}")
    if r["inter_node_gbps"]:
        o.append(f"hardware.inter_node_gbps={_float(r['inter_node_gbps'])}")
    split = uneven_split(layers, pp) if pp > 1 and layers % pp else None
    if split:
        o.append(f"layout.stage_layers=[{','.join(map(str, split))}]")
    sched = r["schedule"].lower()
    if "dualpipe" in sched:
        o.append("schedule=dualpipe")
    else:
        v = _vp(r, layers, pp, split)
        o += (["schedule=interleaved_1f1b", f"layout.vp={v}"] if pp > 1 and v > 1 else ["schedule=1f1b"])
    o += (r.get("overrides") or "").split()  # what the source says its run set beyond the columns (last: they win)
    mfu, hfu, tf = r["mfu_pct_published"], r["hfu_pct_published"], _float(r["tflops_per_gpu"])
    peak = _float(r["peak_tflops_for_mfu"]) or None
    if r["truth"].startswith("hfu"):
        published, metric = float(hfu or mfu) / 100, "hfu"
    elif mfu:
        published, metric = float(mfu) / 100, "mfu"
    elif r["truth"].startswith("mfu_inferred"):
        published, metric = float(r["truth"].split(":")[1]) / 100, "mfu"
    elif tf and peak:
        published, metric = tf / peak, "tflops"
    else:
        published, metric = None, "mfu"
    return Row(r["name"], r["source"], r["family"], r["use"], hw, o, published, metric, tf, r["truth"], gpus,
               gbs * seq, r["recompute"], raw=r, note=r["planner_notes"])


# ---- the sources' FLOP conventions (per step) --------------------------------------------------

def source_flops(r: dict, convention: str) -> float:
    B, s, L, h = (_int(r[k]) for k in ("global_batch_seqs", "seq_len", "layers", "hidden"))
    V, H = _int(r["vocab"]), _int(r["attn_heads"])
    kv = _int(r["kv_heads"], H) or H
    f = _int(r["ffn_hidden"], 4 * h) or 4 * h
    if convention == "megatron_2021":  # Narayanan et al. 2021, Eq. 3: hardware FLOPs with recompute
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    if convention == "megatron_mfu":  # Korthikanti et al. 2022, MegaScale: model FLOPs
        return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    if convention == "megatron_core_r080":  # megatron/training/training.py num_floating_point_operations
        return 12 * B * s * L * h * h * (1 + f / h + kv / H + s / h + V / (2 * L * h))
    if convention == "nemo_noncausal":  # NeMo 24.0x flops_formulas.llama2 (checked on the 24.07 rows)
        return B * s * L * h * h * (12 + 12 * kv / H + 18 * f / h + 12 * s / h + 6 * V / (L * h))
    raise ValueError(f"unknown FLOP convention {convention!r}")


def true_step_s(row: Row, plan) -> float | None:
    """The run's step time from what its source prints."""
    r, truth = row.raw, row.truth
    kind, _, conv = truth.partition(":")
    peak = _float(r["peak_tflops_for_mfu"]) or plan.spec.hardware.peak_tflops
    if kind == "tokens_per_s_per_gpu":
        return row.tokens / (float(r["tokens_per_s_per_gpu"]) * row.gpus)
    if kind == "iter_time_s":
        return float(r["iter_time_s"])
    if kind == "tflops_per_gpu":
        return source_flops(r, conv) / (float(r["tflops_per_gpu"]) * 1e12 * row.gpus)
    if kind in ("hfu_pct_published", "mfu_pct_published", "mfu_inferred"):
        frac = row.published
        own = kind == "mfu_inferred" or conv in ("planner", "")
        flops = plan.model_flops_per_step if own else source_flops(r, conv)
        return flops / (frac * peak * 1e12 * row.gpus)
    return None


# ---- planning the rows -------------------------------------------------------------------------

@dataclass
class Prediction:
    row: Row
    plan: object
    predicted: float | None  # MFU, this planner's convention
    truth: float | None  # the run's MFU in the same convention (from its printed throughput)
    step_s: float | None = None  # the run's step time

    @property
    def error(self) -> float | None:
        return None if self.predicted is None or self.truth is None else self.predicted - self.truth


_SPECS: dict[str, object] = {}
_BASES: dict[tuple, object] = {}
_SHAPES: dict[str, object] = {}  # row -> its layout placed (plan.Shaped) or its rejected Plan
_MM: dict[str, object] = {}


def _compose(overrides: list[str]):
    """Hydra composes the config groups (once per combination); the dotted keys are set on a
    copy, as Hydra would, without composing again (ninety rows compose in seconds)."""
    import yaml
    from omegaconf import OmegaConf

    from orchestrator.config.compose import compose, typed

    groups = tuple(o for o in overrides if "." not in o.split("=", 1)[0])
    if groups not in _BASES:
        _BASES[groups] = compose(list(groups))
    cfg = _BASES[groups].copy()
    for o in overrides:
        key, _, value = o.partition("=")
        if "." in key:
            OmegaConf.update(cfg, key, yaml.safe_load(value), merge=False)
    return typed(cfg)


def row_spec(row: Row):
    """The typed config of a row (composed once), with the recompute the run needs."""
    from orchestrator.config.schema import Recompute

    if row.name in _SPECS:
        return _SPECS[row.name]
    spec = _compose(list(row.overrides))
    if row.recompute == "least":
        spec = least_recompute(spec)
    else:
        spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training,
                                                                      recompute=Recompute(row.recompute)))
    _SPECS[row.name] = spec
    return spec


def least_recompute(spec):
    """A run that does not say how it recomputes did the least that fits: none, selective,
    then whole layers of each model chunk (Megatron's block method), then every layer."""
    from orchestrator.config.schema import Recompute
    from orchestrator.plan.judge import memory_only

    def fits(rec, layers=None):
        alt = dataclasses.replace(spec, training=dataclasses.replace(spec.training, recompute=Recompute(rec),
                                                                     recompute_layers=layers))
        mem = memory_only(alt)
        return alt if mem is not None and mem.fits else None

    for rec in ("none", "selective"):
        alt = fits(rec)
        if alt is not None:
            return alt
    layout_spec = spec.layout
    chunk = -(-spec.model.layers // max(layout_spec.pp * max(layout_spec.vp, 1), 1))
    lo, hi = 1, chunk  # the fewest recomputed layers per chunk that fit (memory falls with more)
    if fits("full", hi) is None:
        return dataclasses.replace(spec, training=dataclasses.replace(spec.training, recompute=Recompute.full))
    while lo < hi:
        mid = (lo + hi) // 2
        if fits("full", mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    return fits("full", lo)


def _model_math(spec):
    from orchestrator.plan.model import ModelMath

    key = repr(spec.model)
    if key not in _MM:
        _MM[key] = ModelMath(spec.model)
    return _MM[key]


def with_params(spec, params: dict | None):
    if not params:
        return spec
    gen = GENERATION.get(spec.hardware.name)
    hw = spec.hardware
    if gen and f"gemm_efficiency:{gen}" in params:
        hw = dataclasses.replace(hw, gemm_efficiency=params[f"gemm_efficiency:{gen}"])
    cost = dataclasses.replace(spec.cost, **{k: params[k] for k in SHARED if k in params})
    return dataclasses.replace(spec, hardware=hw, cost=cost)


def predict_one(row: Row, params: dict | None = None) -> Prediction:
    from orchestrator.plan.plan import Plan, cost_plan, shape_plan

    spec = row_spec(row)
    if row.name not in _SHAPES:  # the fitted coefficients change the costs, never the shape
        _SHAPES[row.name] = shape_plan(spec, mm=_model_math(spec))
    shaped = _SHAPES[row.name]
    plan = shaped if isinstance(shaped, Plan) else cost_plan(shaped, with_params(spec, params))
    if plan.step is None:
        return Prediction(row, plan, None, None)
    step = true_step_s(row, plan)
    truth = (plan.model_flops_per_step / (plan.world_size * plan.spec.hardware.peak_tflops * 1e12 * step)
             if step else None)
    return Prediction(row, plan, plan.mfu, truth, step)


def time_shares(pred: Prediction) -> dict[str, float]:
    """Where a row's predicted step goes, as shares of it: the step's parts (Step.wall_*) and,
    within the compute, the attention core's kernel time (the plan's attention_share, which the
    MFU interval's low end reads). Empty for a row with no step."""
    plan, shaped = pred.plan, _SHAPES.get(pred.row.name)
    step = getattr(plan, "step", None)
    if step is None or not step.wall_s or not hasattr(shaped, "stages"):  # a rejected layout: no stages
        return {}
    out = {k: getattr(step, "wall_" + k) / step.wall_s for k in ("compute", "tp", "cp", "ep", "pp_bubble", "p2p",
                                                                   "dp_exposed")}
    out["attention"] = plan.attention_share or 0.0  # plan/uncertainty.py attention_share
    return out


def predict(rows: list[Row], params: dict | None = None) -> list[Prediction]:
    return [predict_one(r, params) for r in rows]


def current_params() -> dict:
    """The fitted numbers as the presets and the schema hold them."""
    from orchestrator.config.compose import compose, typed

    out = {}
    for gen, hw in (("ampere", "a100_80gb"), ("hopper", "h100_sxm"), ("blackwell", "b200")):
        out[f"gemm_efficiency:{gen}"] = typed(compose([f"hardware={hw}"])).hardware.gemm_efficiency
    cost = typed(compose([])).cost
    out.update({k: getattr(cost, k) for k in SHARED})
    return out


# ---- fitting -------------------------------------------------------------------------------------

BOUNDS = {"gemm_efficiency": (0.2, 1.0), "elementwise": (0.0, 20.0),
          "attention_efficiency": (0.1, 1.0), "fp8_gemm_efficiency": (0.3, 1.0), "launch_overhead_us": (0.0, 2000.0)}


def _bounded(name: str, v: float) -> float:
    lo, hi = BOUNDS[name.split(":")[0]]
    return min(max(v, lo), hi)


def fit(rows: list[Row], start: dict | None = None, iterations: int = 8, verbose: bool = False) -> dict:
    """Levenberg-Marquardt on the MFU residuals of the rows (log-parameters, numeric
    Jacobian through the planner). Parameters no row informs keep their start value."""
    import numpy as np

    rows = [r for r in rows if r.use == "fit"]
    params = dict(start or current_params())
    gens = {GENERATION.get(r.hardware) for r in rows}
    names = [p for p in PARAMS if not p.startswith("gemm_efficiency:") or p.split(":")[1] in gens]
    if not any("fp8" in " ".join(r.overrides) for r in rows):
        names = [p for p in names if p != "fp8_gemm_efficiency"]
    off = {"launch_overhead_us": 1.0, "elementwise": 0.05}  # log(x + off): zero allowed

    def to_x(p):
        return np.array([math.log(p[n] + off.get(n, 0.0)) for n in names])

    def from_x(x):
        p = dict(params)
        for n, v in zip(names, x):
            p[n] = _bounded(n, math.exp(v) - off.get(n, 0.0))
        return p

    def residuals(p):
        out = []
        for r in rows:
            pr = predict_one(r, p)
            out.append(pr.error if pr.error is not None else 0.0)
        return np.array(out)

    x = to_x(params)
    res = residuals(params)
    lam = 1e-2
    for it in range(iterations):
        J = np.zeros((len(rows), len(names)))
        for k in range(len(names)):
            step = 0.02
            xk = x.copy()
            xk[k] += step
            J[:, k] = (residuals(from_x(xk)) - res) / step
        A = J.T @ J
        g = J.T @ res
        improved = False
        for _ in range(6):
            dx = -np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-9), g)
            cand = x + np.clip(dx, -1.0, 1.0)
            new = residuals(from_x(cand))
            if new @ new < res @ res:
                x, res, lam, improved = to_x(from_x(cand)), new, lam / 3, True
                break
            lam *= 4
        if verbose:
            print(f"  iteration {it}: MAE {100 * np.mean(np.abs(res)):.2f} points, lambda {lam:.2g}")
        if not improved or lam > 1e6:
            break
    return from_x(x)


def _unseen(train: list[Row], fitted: dict) -> dict:
    """A fold's parameters for a GPU generation no training row runs on: the GEMM ceiling fitted
    in the fold for the nearest generation that has rows, the one before it (else the one after).
    The fitted ceilings fall from each generation to the next (Ampere 0.64, Hopper 0.57, Blackwell
    0.54 of the datasheet peak, which grows faster than what feeds it), so a new generation is
    closer to its predecessor than to the mean of every earlier one (the rule before: megatron_bridge's
    Blackwell rows, the only ones, 9.1% off left out, 6.1% now). The fold's own fit: no peeking."""
    gens = {GENERATION.get(r.hardware) for r in train if r.use == "fit"}
    order = ("ampere", "hopper", "blackwell")
    out = dict(fitted)
    for i, g in enumerate(order):
        near = [h for h in order[:i][::-1] if h in gens] or [h for h in order[i + 1:] if h in gens]
        if g not in gens and near:
            out[f"gemm_efficiency:{g}"] = fitted[f"gemm_efficiency:{near[0]}"]
    return out


def loso(rows: list[Row], params: dict, iterations: int = 3) -> dict[str, list[Prediction]]:
    """Leave one source out: refit without each family, predict its rows."""
    out = {}
    for fam in sorted({r.family for r in rows}):
        train = [r for r in rows if r.family != fam]
        p = _unseen(train, fit(train, start=params, iterations=iterations))
        out[fam] = [predict_one(r, p) for r in rows if r.family == fam]
    return out


@dataclass
class Evaluation:
    params: dict
    after: list[Prediction]  # in sample (the fit on every `use=fit` row)
    after_loso: dict[str, list[Prediction]] = field(default_factory=dict)


def evaluate(rows: list[Row] | None = None, refit: bool = True, loso_folds: bool = True,
             iterations: int = 8) -> Evaluation:
    """The fitted model's predictions, in sample and leave-one-source-out."""
    rows = rows if rows is not None else load_runs()
    params = fit(rows, iterations=iterations) if refit else current_params()
    ev = Evaluation(params, predict(rows, params))
    if loso_folds:
        ev.after_loso = loso(rows, params)
    return ev


def fit_measured(pairs: list[tuple[float, float]]) -> float:
    """Refit from a site's runs: (predicted useful fraction at eff 1, measured MFU) pairs."""
    num = sum(u * y for u, y in pairs)
    den = sum(u * u for u, _ in pairs)
    if den <= 0:
        raise ValueError("no usable measurements to fit")
    return num / den
