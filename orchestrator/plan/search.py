"""layout=auto: choose TP, CP, PP, DP (EP), virtual stages, micro-batch, recompute and
schedule with the plan's own model, following the published procedure: Llama 3 (Dubey et al.
2024, arXiv:2407.21783, section 3.3.2, order [TP, CP, PP, DP]) and Megatron-LM (Narayanan et
al. 2021, arXiv:2104.04473, section 3.4, takeaways 1-3):
TP up to the node (and the KV-head count), CP only if the sequence
does not fit, PP deep enough and no deeper, DP fills the rest, then as many
micro-batches as the global batch allows. The search enumerates exactly those
degrees (TP divides the node and the heads, CP a power of two the sequence
splits into, PP a depth the layers split into, evenly or with lighter end
stages, DP what is left), gives each degree tuple the least recomputation that
fits and the best schedule for it, and ranks the tuples by predicted step time.
Phase 2 refines the best few over micro-batch size, virtual stages and schedule.
For the chosen layout it says why each neighbour lost.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from orchestrator.config.errors import Problem
from orchestrator.config.schedules import SCHEDULES
from orchestrator.config.schema import Config, Recompute, Schedule
from orchestrator.plan.inventory import GiB
from orchestrator.plan.judge import memory_only
from orchestrator.plan.layout import layout_label
from orchestrator.plan.model import ModelMath
from orchestrator.plan.plan import Plan, plan_spec
from orchestrator.plan.validate import accounted_chunks, uneven_split, validate

RECOMPUTE = ("none", "selective", "full")


@dataclass
class Candidate:
    tp: int
    cp: int
    pp: int
    dp: int
    ep: int = 1

    @property
    def key(self):
        return (self.tp, self.cp, self.pp, self.dp, self.ep)

    def label(self) -> str:
        return layout_label(self.tp, self.cp, self.pp, self.dp, self.ep)


def _variant(spec: Config, c: Candidate, *, schedule: str, vp: int, recompute: str, micro_batch: int) -> Config:
    """spec with this layout; the model and hardware are shared, not copied."""
    L = spec.model.layers
    own = accounted_chunks(spec.stack.pipeline_accounting, L, c.pp, c.pp * SCHEDULES[schedule].chunks(vp))
    layout = dataclasses.replace(spec.layout, tp=c.tp, cp=c.cp, pp=c.pp, dp=c.dp, ep=c.ep, vp=vp, search=False,
                                 stage_layers=uneven_split(L, c.pp) if L % c.pp and own is None else None)
    training = dataclasses.replace(spec.training, recompute=Recompute(recompute), micro_batch=micro_batch)
    sched = dataclasses.replace(spec.schedule, name=Schedule[schedule], microbatches=None)
    return dataclasses.replace(spec, layout=layout, training=training, schedule=sched)


def _pow2_upto(n: int) -> list[int]:
    out, x = [], 1
    while x <= n:
        out.append(x)
        x *= 2
    return out


def candidates(spec) -> list[Candidate]:
    hw, m, tr = spec.hardware, spec.model, spec.training
    world = spec.cluster.nodes * hw.gpus_per_node
    domain = spec.fabric.nvlink_domain or hw.gpus_per_node  # TP stays on NVLink (a node, or an NVL72 rack)
    tps = [t for t in range(1, min(domain, 64) + 1) if domain % t == 0 and m.heads % t == 0
           and (m.kv_heads % t == 0 or t % m.kv_heads == 0)]
    cps = [c for c in _pow2_upto(64) if tr.seq_len % (2 * c) == 0 or c == 1]
    pps = [p for p in range(1, min(m.layers, 128) + 1) if m.layers % p == 0 or uneven_split(m.layers, p)]
    eps = [e for e in _pow2_upto(m.moe.experts) if m.moe.experts % e == 0] if m.moe.experts else [1]
    out = []
    for t in tps:
        for c in cps:
            for p in pps:
                mp = t * c * p
                if world % mp:
                    continue
                dp = world // mp
                if tr.global_batch % dp:
                    continue
                for e in eps:  # the expert grid (etp = tp) must tile the world too
                    if world % (t * e * p) == 0:
                        out.append(Candidate(t, c, p, dp, e))
    return out


def _schedules(spec, c: Candidate, micro_batch: int, refine: bool) -> list[tuple[str, int]]:
    if c.pp == 1:
        return [("1f1b", 1)]
    m = spec.training.global_batch // (c.dp * micro_batch)
    L = spec.model.layers
    smallest = min(uneven_split(L, c.pp) or [L // c.pp])
    even = L % c.pp == 0
    vps = [v for v in range(2, min(smallest, 8) + 1) if (not even or (L // c.pp) % v == 0)] if m % c.pp == 0 else []
    out = [("1f1b", 1)]
    own = spec.schedule.name.value
    if SCHEDULES[own].overlaps_ep and c.ep > 1 and m % 2 == 0 and m >= 2 * c.pp:
        out.append((own, 1))  # DualPipe: the user's schedule that hides the expert all-to-all
    if vps:
        out += [("interleaved_1f1b", v) for v in (vps if refine else vps[-1:])]
    if refine:
        out.append(("zero_bubble", 1))
    return out


def _best_for(spec, c: Candidate, mm: ModelMath, refine: bool, micro_batches=(1,)):
    """The fastest fitting settings for one degree tuple (and a note when it needs
    recomputation to fit), or why none fits."""
    best, smallest_mem, reason, no_recompute = None, None, None, None
    for b in micro_batches:
        if spec.training.global_batch % (c.dp * b):
            continue
        m = spec.training.global_batch // (c.dp * b)
        if c.pp > 1 and m < c.pp:  # a stack may run it (Megatron caps the warm-up), but the search
            reason = reason or (f"{c.label()}: {m} micro-batch(es) cannot fill {c.pp} pipeline stages "
                                f"(bubble {(c.pp - 1) / (m + c.pp - 1):.0%})")  # never proposes such a pipeline
            continue
        for schedule, vp in _schedules(spec, c, b, refine):
            for rec in RECOMPUTE:
                var = _variant(spec, c, schedule=schedule, vp=vp, recompute=rec, micro_batch=b)
                mem = memory_only(var, mm)
                if mem is None:  # structurally invalid whatever the recompute
                    reason = reason or f"{c.label()}: {_first_problem(var)}"
                    break
                if not mem.fits:
                    if smallest_mem is None or mem.per_gpu_bytes < smallest_mem.per_gpu_bytes:
                        smallest_mem = mem
                    if rec == "none" and (no_recompute is None or mem.per_gpu_bytes < no_recompute.per_gpu_bytes):
                        no_recompute = mem
                    continue
                plan = plan_spec(var, mm=mm)
                if not plan.valid:
                    reason = reason or str(plan.errors[0])
                    break
                if best is None or plan.step.wall_s < best.step.wall_s:
                    best = plan
                break  # more recomputation only adds work
    note = None
    if best is not None and best.spec.training.recompute != "none" and no_recompute is not None:
        note = (f"does not fit without recompute: {no_recompute.per_gpu_bytes / GiB:.1f} GiB > "
                f"{no_recompute.capacity_bytes / GiB:.0f} GiB; fits with "
                f"recompute={best.spec.training.recompute.value}")
    if best is None and smallest_mem is not None:
        reason = (f"{c.label()} does not fit: {smallest_mem.per_gpu_bytes / GiB:.1f} GiB > "
                  f"{smallest_mem.capacity_bytes / GiB:.0f} GiB even with full recompute")
    return best, reason, note


def _first_problem(spec) -> str:
    _, problems, _ = validate(spec)
    return problems[0].message if problems else "not valid"


def _gib(reason: str) -> float:
    import re

    m = re.search(r"([0-9.]+) GiB >", reason)
    return float(m.group(1)) if m else float("inf")


def _row(rank: int, plan) -> dict:
    d, tr = plan.layout, plan.spec.training
    return {"rank": rank, "tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp, "ep": d.ep, "vp": d.vp,
            "schedule": d.schedule.name, "recompute": tr.recompute.value, "micro_batch": tr.micro_batch,
            "layout": f"{d.label()} {d.schedule.name} mb{tr.micro_batch} recompute={tr.recompute.value}",
            "wall_s": plan.step.wall_s, "total_s": plan.step.total_s, "mfu": plan.mfu,
            "mfu_interval": plan.mfu_interval,
            "memory_gib": plan.memory.per_gpu_bytes / GiB,
            "budget": {k: getattr(plan.step, k) for k in ("compute", "tp", "cp", "ep", "pp_bubble", "p2p",
                                                            "dp_exposed")}}


def rank_key(plan) -> tuple:
    """Candidates rank by the low end of their MFU interval (the MFU they reach at 90%
    confidence), then by predicted step. Where two intervals do not overlap this is the
    order of the predictions; where they overlap, the layout the model is surer of wins.
    Without an interval (hardware=cpu, constant kernel model): by predicted step."""
    lo = plan.mfu_interval[0] if plan.mfu_interval else None
    return (-lo if lo is not None else 0.0, plan.step.wall_s)


def search(spec: Config, refine_top: int = 5):
    """Plan every candidate; return the best plan with the ranking in `plan.search`."""
    mm = ModelMath(spec.model)
    cands = candidates(spec)
    results: dict[tuple, tuple] = {}  # key -> (candidate, plan, note)
    reasons: dict[tuple, str] = {}

    def run(pool):
        for c in pool:
            best, why, note = _best_for(spec, c, mm, refine=False)
            if best is not None:
                results[c.key] = (c, best, note)
            else:
                reasons[c.key] = why or f"{c.label()} is not valid"

    # Context parallelism only if the sequence does not fit without it.
    run([c for c in cands if c.cp == 1])
    why_cp = None
    if not results and any(c.cp > 1 for c in cands):
        no_cp = [r for k, r in reasons.items() if k[1] == 1]
        mem = sorted((r for r in no_cp if "does not fit" in r), key=_gib)[:1]
        other = [r for r in no_cp if "does not fit" not in r][:2]
        why_cp = (f"CP > 1 because none of the {len(no_cp)} layouts without context parallelism is valid and "
                  f"fits: " + "; ".join(mem + other))
        run([c for c in cands if c.cp > 1])
    ranked = sorted(results.values(), key=lambda r: rank_key(r[1]))
    for c, _, _ in ranked[:refine_top]:  # phase 2: micro-batch size, virtual stages, schedule
        best, _, note = _best_for(spec, c, mm, refine=True, micro_batches=(1, 2, 4))
        if best is not None and best.step.wall_s < results[c.key][1].step.wall_s:
            results[c.key] = (c, best, note)
    ranked = sorted(results.values(), key=lambda r: rank_key(r[1]))
    if not ranked:
        return _nothing_fits(spec, cands, reasons)
    chosen_c, chosen, note = ranked[0]
    top = [_row(i + 1, p) for i, (_, p, _) in enumerate(ranked[: max(spec.search.top, 3)])]
    chosen.search = {"candidates": len(cands), "fitting": len(ranked), "top": top, "note": note,
                     "rejected": ([why_cp] if why_cp else []) + _neighbours(chosen_c, chosen, results, reasons, spec)}
    return chosen


def _nothing_fits(spec: Config, cands: list[Candidate], reasons: dict):
    world = spec.cluster.nodes * spec.hardware.gpus_per_node
    why = sorted(set(reasons.values()))[:5]
    if not cands:
        why = [f"no tp (dividing the {spec.hardware.gpus_per_node}-GPU node and the {spec.model.heads} heads) x "
               f"cp x pp (at most {min(spec.model.layers, 128)} stages) leaves a dp that divides {world} GPUs "
               f"and the global batch of {spec.training.global_batch}"]
    return Plan(valid=False, world_size=world, spec=spec, warnings=[], errors=[Problem(
        "layout", f"no layout of {len(cands)} candidates fits {spec.model.name} on {world} GPUs: " + "; ".join(why),
        "add nodes, shorten training.seq_len, or change training.global_batch to a multiple of more dp sizes.")],
        search={"candidates": len(cands), "top": [], "rejected": why})


def _neighbours(c: Candidate, chosen, results, reasons, spec) -> list[str]:
    """Why each layout one step away from the chosen one lost."""
    world = spec.cluster.nodes * spec.hardware.gpus_per_node
    out = []
    for axis in ("tp", "cp", "pp"):
        for f in (2, 0.5):
            deg = dict(tp=c.tp, cp=c.cp, pp=c.pp)
            deg[axis] = int(deg[axis] * f)
            if deg[axis] < 1:
                continue
            mp = deg["tp"] * deg["cp"] * deg["pp"]
            if world % mp:
                continue
            n = Candidate(deg["tp"], deg["cp"], deg["pp"], world // mp, c.ep)
            if n.key in results:
                _, other, note = results[n.key]
                out.append(f"{n.label()} is slower: {other.step.wall_s:.2f} s vs {chosen.step.wall_s:.2f} s per "
                           f"step ({100 * (other.step.wall_s / chosen.step.wall_s - 1):+.0f}%), MFU "
                           f"{other.mfu:.1%}" + (f" ({n.label()} {note})" if note else ""))
            elif n.key in reasons:
                out.append(reasons[n.key])
            elif n.cp > 1 and c.cp == 1:
                out.append(f"{n.label()} was not considered: context parallelism only when the sequence does "
                           f"not fit without it, and {c.label()} fits")
            elif n.tp > spec.hardware.gpus_per_node:
                out.append(f"{n.label()}: TP{n.tp} would leave the {spec.hardware.gpus_per_node}-GPU NVLink "
                           f"domain (tensor parallelism stays inside a node)")
            else:
                var = _variant(spec, n, schedule="1f1b", vp=1, recompute="none", micro_batch=1)
                out.append(f"{n.label()} is not valid: {_first_problem(var)}")
    return out
