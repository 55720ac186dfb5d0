"""Calibration against published runs, and refitting from a site's own runs.

The model has one fitted number per hardware: `kernel_efficiency`, the fraction
of the roofline its kernels reach. MFU = useful fraction x kernel efficiency
(seed 1) and the useful fraction does not depend on the efficiency, so the
least-squares fit is closed-form: eff = sum(u_i y_i) / sum(u_i^2), where u_i is
a row's predicted MFU at efficiency 1 and y_i its published figure (in the
metric the source uses: Megatron 2021's "% of peak" counts recompute FLOPs, so
it is compared with HFU; Llama 3 reports model-FLOP MFU).

Every row is planned from its own columns by fixed rules (no per-row
constants): GPT rows use GeLU, tied embeddings, dropout and no flash
attention (2021); interleaved schedules use one layer per virtual stage on the
smallest stage (capped at 8) because the sources do not give V; an uneven
split gives the first and last stage one layer fewer when the layers do not
divide (Llama 3, Sec. 3.3.2).
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from orchestrator.plan.validate import uneven_split

CALIBRATION_CSV = Path(__file__).resolve().parents[2] / "published" / "calibration.csv"
HARDWARE = {"A100": "a100_80gb", "H100": "h100_sxm", "H800": "h800"}


@dataclass
class Row:
    name: str
    source: str
    hardware: str
    overrides: list[str]
    published: float | None  # fraction
    metric: str  # mfu | hfu
    tflops: float | None
    note: str = ""


def _int(x: str, default: int | None = None) -> int | None:
    m = re.match(r"\s*(\d+)", x or "")
    return int(m.group(1)) if m else default


def load_rows(path: Path = CALIBRATION_CSV) -> list[Row]:
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            rows.append(row_to_overrides(r))
    return rows


def row_to_overrides(r: dict) -> Row:
    hw = next(v for k, v in HARDWARE.items() if k in r["gpu_type"])
    gpn = _int(r["gpus_per_node"], 8)
    tp, cp, pp = _int(r["TP"], 1), _int(r["CP"], 1), _int(r["PP"], 1)
    dp, ep = _int(r["DP"], 1), _int(r["EP"], 1)
    gpt = "GPT" in r["model_family"]
    moe = "MoE" in r["model_family"]
    layers = _int(r["layers"])
    o = [f"hardware={hw}", f"hardware.gpus_per_node={gpn}", f"cluster.nodes={_int(r['gpu_count']) // gpn}",
         f"training.seq_len={_int(r['seq_len'])}", f"training.global_batch={_int(r['global_batch_seqs'])}",
         f"training.micro_batch={_int(r['micro_batch'], 1)}",
         f"layout.tp={tp}", f"layout.cp={cp}", f"layout.pp={pp}", f"layout.dp={dp}", f"layout.ep={ep}"]
    if moe:
        o += ["model=deepseek_v3"]
    else:
        o += ["model=llama3_405b" if not gpt else "model=gpt_1t",
              f"model.name={re.sub(r'[^A-Za-z0-9_.]+', '_', r['name'])[:60]}",
              f"model.layers={layers}", f"model.hidden={_int(r['hidden'])}",
              f"model.ffn_hidden={_int(r['ffn_hidden'])}", f"model.heads={_int(r['attn_heads'])}",
              f"model.kv_heads={_int(r['kv_heads'])}", f"model.vocab={_int(r['vocab'])}"]
    rec = r["act_recompute"].lower()
    o.append("training.recompute=" + ("full" if rec.startswith("full") else
                                      "selective" if rec.startswith("selective") else "none"))
    if gpt:  # Megatron 2021: DDP gradients, no flash attention
        o += ["layout.zero=0", "training.flash_attention=false"]
    elif moe:
        o += ["layout.zero=1", "training.precision=fp8", "training.optimizer_bytes=8"]
    else:  # Llama 3 on Meta's cluster (Sec. 3.3)
        o += ["layout.zero=2", "fabric=llama3_meta"]
    sched = r["schedule"].lower()
    stage_layers = None
    if pp > 1 and layers % pp:
        stage_layers = uneven_split(layers, pp)
        if stage_layers:
            o.append(f"layout.stage_layers=[{','.join(map(str, stage_layers))}]")
    if "dualpipe" in sched:
        o.append("schedule=dualpipe")
        if stage_layers is None and layers % pp:
            pass
    elif "interleaved" in sched and pp > 1:
        smallest = min(stage_layers) if stage_layers else layers // pp
        v = max(x for x in range(1, min(smallest, 8) + 1) if stage_layers or (layers // pp) % x == 0)
        o += ["schedule=interleaved_1f1b", f"layout.vp={v}"]
    else:
        o.append("schedule=1f1b")
    mfu, hfu = r["mfu_pct_published"], r["hfu_pct_published"]
    metric = "hfu" if gpt else "mfu"
    val = float(mfu) / 100 if mfu else (float(hfu) / 100 if hfu else None)
    tflops = float(r["tflops_per_gpu"]) if r["tflops_per_gpu"] else None
    return Row(r["name"], r["source"], hw, o, val, metric, tflops, r["notes"])


@dataclass
class Prediction:
    row: Row
    plan: object
    predicted: float | None  # in the row's metric
    unit_efficiency: float | None  # the same at kernel efficiency 1


def predict(rows: list[Row], efficiency: dict[str, float] | None = None) -> list[Prediction]:
    from orchestrator.config.compose import compose
    from orchestrator.plan import make_plan

    out = []
    for row in rows:
        extra = [f"hardware.kernel_efficiency={efficiency[row.hardware]}"] if efficiency and row.hardware in efficiency else []
        plan = make_plan(compose(row.overrides + extra))
        if plan.step is None:
            out.append(Prediction(row, plan, None, None))
            continue
        value = plan.hfu if row.metric == "hfu" else plan.mfu
        eff = plan.spec.hardware.kernel_efficiency
        out.append(Prediction(row, plan, value, value / eff))
    return out


def fit(predictions: list[Prediction]) -> dict[str, float]:
    """Least-squares kernel efficiency per hardware from the rows with a published figure."""
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for p in predictions:
        if p.row.published is None or p.unit_efficiency is None:
            continue
        hw = p.row.hardware
        num[hw] = num.get(hw, 0.0) + p.unit_efficiency * p.row.published
        den[hw] = den.get(hw, 0.0) + p.unit_efficiency ** 2
    return {hw: num[hw] / den[hw] for hw in num}


def fit_measured(pairs: list[tuple[float, float]]) -> float:
    """Refit from a site's runs: (predicted useful fraction at eff 1, measured MFU) pairs."""
    num = sum(u * y for u, y in pairs)
    den = sum(u * u for u, _ in pairs)
    if den <= 0:
        raise ValueError("no usable measurements to fit")
    return num / den
