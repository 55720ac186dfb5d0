"""make_plan(cfg) -> Plan: validate, inventory, rank order, cost. Torch-free.

The Plan is the contract between the planner, the launchers and the runtime:
`Plan.to_json()` is what `plan.json` holds (DESIGN.md, "Plan contract"), and
the runtime builds its process groups from `plan.grid()` alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orchestrator.plan.cost import DP_GROUP, AxisReport, Step, auto_order, axis_traffic, step_time
from orchestrator.plan.errors import PlanError, Problem
from orchestrator.plan.inventory import GiB, Memory, inventory
from orchestrator.plan.model import ModelMath
from orchestrator.plan.spec import spec_to_dict, to_spec
from orchestrator.plan.stages import build_stages
from orchestrator.plan.topology import RankGrid, Tier, tiers_for
from orchestrator.plan.validate import Degrees, validate

# Which grid axes carry each reported axis' traffic.
AXIS_GROUPS = {"tp": ("tp",), "cp": ("cp",), "ep": ("ep",), "pp": ("pp",), "dp": DP_GROUP}


@dataclass
class Plan:
    valid: bool
    errors: list[Problem]
    warnings: list[str]
    world_size: int
    spec: Any
    degrees: Degrees | None = None
    memory: Memory | None = None
    step: Step | None = None
    axes: dict[str, AxisReport] = field(default_factory=dict)
    order: list[str] | None = None
    mfu: float | None = None
    hfu: float | None = None
    tflops_per_gpu: float | None = None
    tokens_per_s: float | None = None
    model_flops_per_step: float | None = None
    blast_radius: dict | None = None
    params: int | None = None
    active_params: int | None = None
    search: dict | None = None  # layout=auto: the ranking and why the neighbours lost

    def grid(self) -> RankGrid:
        if not self.degrees:
            raise PlanError(self.errors)
        return RankGrid(self.degrees.sizes, self.order)

    def raise_if_invalid(self) -> "Plan":
        if not self.valid:
            raise PlanError(self.errors)
        return self

    def to_json(self) -> dict:
        d = self.degrees
        out: dict[str, Any] = {
            "valid": self.valid,
            "errors": [e.to_dict() for e in self.errors],
            "warnings": self.warnings,
            "world_size": self.world_size,
            "model": {"name": self.spec.model.name, "params": self.params, "active_params": self.active_params},
            "hardware": self.spec.hardware.name,
            "nodes": self.spec.cluster.nodes,
        }
        if d:
            out["layout"] = {"tp": d.tp, "cp": d.cp, "pp": d.pp, "dp": d.dp, "ep": d.ep, "vp": d.vp,
                             "zero": d.zero, "order": self.order, "microbatches": d.microbatches,
                             "micro_batch": self.spec.training.micro_batch, "stage_layers": d.stage_layers,
                             "schedule": d.schedule, "recompute": self.spec.training.recompute}
        if self.memory:
            out["memory"] = self.memory.to_json()
        if self.step:
            out["step"] = self.step.to_json()
            out.update(mfu=self.mfu, hfu=self.hfu, tflops_per_gpu=self.tflops_per_gpu,
                       tokens_per_s=self.tokens_per_s, model_flops_per_step=self.model_flops_per_step)
            out["axes"] = [a.to_json() for a in self.axes.values() if a.size > 1]
            out["ranks"] = self.grid().to_json()
            out["blast_radius"] = self.blast_radius
        pub = getattr(self.spec, "published", None)
        if pub is not None:
            out["published"] = spec_to_dict(pub)
        if self.search:
            out["search"] = self.search
        out["config"] = spec_to_dict(self.spec)
        return out


def make_plan(cfg: Any) -> Plan:
    """Plan a configuration (a Hydra DictConfig, a `Config` dataclass or a plain dict).

    Never raises for a bad configuration: the Plan comes back with `valid=False`
    and every problem in `errors`. Call `plan.raise_if_invalid()` to get a PlanError.
    """
    spec = to_spec(cfg)
    if spec.layout.search:
        from orchestrator.plan.search import search

        return search(spec)
    return plan_spec(spec)


def plan_spec(spec, order_override: list[str] | None = None, mm: ModelMath | None = None) -> Plan:
    degrees, problems, warnings = validate(spec)
    world = spec.cluster.nodes * spec.hardware.gpus_per_node
    plan = Plan(valid=False, errors=problems, warnings=list(warnings), world_size=world, spec=spec)
    if degrees is None:
        return plan
    mm = mm or ModelMath(spec.model)
    tr, hw, lay = spec.training, spec.hardware, spec.layout
    plan.params, plan.active_params = mm.total_params, mm.active_params
    stages = build_stages(mm, degrees, tr.seq_len, tr.recompute, tr.flash_attention, spec.cost.attention_flops)
    sp = lay.sequence_parallel
    axes = axis_traffic(stages, degrees, mm, tr, hw, sp)
    order = order_override or degrees.order or auto_order(axes)
    grid = RankGrid(degrees.sizes, order)
    tier_list = tiers_for(hw)
    tiers: dict[str, Tier] = {}
    for name, group in AXIS_GROUPS.items():
        tier = grid.tier_of(group, tier_list)
        tiers[name] = tier
        a = axes[name]
        a.tier, a.gbps, a.latency_us = tier.name, tier.gbps, tier.latency_us
        a.groups = grid.world // max(int(np.prod([grid.sizes[x] for x in group])), 1)
        a.straddling_groups = int(grid.straddling(group, hw.gpus_per_node).sum())
    step = step_time(stages, degrees, mm, tr, hw, axes, tiers)
    memory = inventory(stages, degrees, hw, tr, mm.V)
    plan.degrees, plan.order, plan.axes, plan.step, plan.memory = degrees, order, axes, step, memory

    tokens = tr.global_batch * tr.seq_len
    model_flops = mm.model_flops_per_token(tr.seq_len, spec.cost.attention_flops) * tokens
    hw_flops = model_flops * sum(s.hw_flops_tok for s in stages) / max(sum(s.model_flops_tok for s in stages), 1e-30)
    peak = hw.peak_tflops * 1e12
    plan.model_flops_per_step = model_flops
    plan.mfu = model_flops / (world * peak * step.wall_s)
    plan.hfu = hw_flops / (world * peak * step.wall_s)
    plan.tflops_per_gpu = plan.mfu * hw.peak_tflops
    plan.tokens_per_s = tokens / step.wall_s
    plan.blast_radius = blast_radius(spec, degrees, grid, mm)

    _judge_cross_node_tp(plan, spec, degrees, axes, tier_list, step)
    _judge_memory(plan, spec, degrees, memory)
    plan.valid = not plan.errors
    return plan


def _judge_cross_node_tp(plan, spec, d: Degrees, axes, tier_list, step: Step) -> None:
    a = axes["tp"]
    if d.tp <= 1 or a.tier == "nvlink":
        return
    gpn = spec.hardware.gpus_per_node
    nv = tier_list[0]
    calls = a.calls_per_step / d.microbatches
    # Transfer time alone (bytes / bandwidth), as seed 1 quotes it; the step adds latency.
    on_net = a.bytes_per_microbatch / (a.gbps * 1e9)
    on_nv = a.bytes_per_microbatch / (nv.gbps * 1e9)
    cost = (f"its {calls:.0f} collectives per micro-batch move {a.bytes_per_microbatch / 1e9:.1f} GB over the "
            f"{a.gbps:g} GB/s {a.tier} tier: {on_net:.2f} s instead of {on_nv * 1e3:.0f} ms on NVLink, against "
            f"{step.compute_microbatch_s * 1e3:.0f} ms of arithmetic")
    where = (f"layout.tp={d.tp} spans {math.ceil(d.tp / gpn)} nodes of {gpn} GPUs" if d.tp > gpn else
             f"layout.tp={d.tp} groups straddle nodes of {gpn} GPUs (order {plan.order})")
    if spec.layout.allow_cross_node_tp:
        plan.warnings.append(f"WARNING: {where}: {cost}.")
    else:
        plan.errors.append(Problem("layout.tp", f"{where}: {cost}.",
                                   f"keep tp <= {gpn} and innermost (layout.order=auto), or set "
                                   f"layout.allow_cross_node_tp=true to run it anyway."))


def _judge_memory(plan, spec, d: Degrees, mem: Memory) -> None:
    if mem.fits:
        return
    parts = ", ".join(f"{k} {getattr(mem, k) / GiB:.1f}" for k in ("params", "grads", "optimizer", "activations", "other"))
    fixes = []
    for key, value in (("training.recompute", "selective"), ("training.recompute", "full"), ("layout.zero", 3)):
        alt = _with(spec, key, value)
        if alt is None:
            continue
        p = plan_memory_only(alt)
        if p is not None and p.per_gpu_bytes < mem.per_gpu_bytes:
            fixes.append(f"{key}={value} -> {p.per_gpu_bytes / GiB:.1f} GiB")
    if d.pp * 2 <= spec.model.layers:
        fixes.append(f"more pipeline stages (layout.pp={d.pp * 2}) or more nodes")
    plan.errors.append(Problem(
        "hardware.gpu_memory_gb, training.recompute, layout",
        f"stage {mem.stage} needs {mem.per_gpu_bytes / GiB:.1f} GiB per GPU ({parts} GiB) > "
        f"{spec.hardware.gpu_memory_gb:g} GiB on {spec.hardware.name}.",
        "; ".join(fixes) + "." if fixes else "use more GPUs per replica."))


def _with(spec, dotted: str, value):
    import copy

    alt = copy.deepcopy(spec)
    obj = alt
    *path, last = dotted.split(".")
    for p in path:
        obj = getattr(obj, p)
    if getattr(obj, last) == value:
        return None
    setattr(obj, last, value)
    return alt


def plan_memory_only(spec, mm: ModelMath | None = None) -> Memory | None:
    degrees, problems, _ = validate(spec)
    if degrees is None:
        return None
    mm = mm or ModelMath(spec.model)
    tr = spec.training
    stages = build_stages(mm, degrees, tr.seq_len, tr.recompute, tr.flash_attention, spec.cost.attention_flops)
    return inventory(stages, degrees, spec.hardware, tr, mm.V)


def blast_radius(spec, d: Degrees, grid: RankGrid, mm: ModelMath) -> dict:
    """What one failure costs: GPUs per replica, replicas per node, MTBF, Young/Daly interval."""
    hw = spec.hardware
    gpn = hw.gpus_per_node
    replica_of = (np.arange(grid.world) // grid.strides["dp"]) % grid.sizes["dp"]
    per_node = np.sort(replica_of.reshape(-1, gpn) if grid.world % gpn == 0 else replica_of.reshape(1, -1), axis=1)
    replicas_hit = int((1 + (np.diff(per_node, axis=1) != 0).sum(axis=1)).max())
    rate = hw.failures_per_gpu_hour * grid.world  # interruptions per hour
    mtbf_s = 3600.0 / rate if rate > 0 else float("inf")
    ckpt_bytes = 14.0 * mm.total_params  # bf16 weights + fp32 master + Adam m, v
    ckpt_s = ckpt_bytes / (hw.storage_gbps * 1e9)
    interval = math.sqrt(2.0 * ckpt_s * mtbf_s) if math.isfinite(mtbf_s) else None
    return {
        "gpus_per_replica": d.replica,
        "replicas": grid.world // d.replica,
        "replicas_lost_per_node_failure": replicas_hit,
        "gpus_idled_per_node_failure": replicas_hit * d.replica,
        "job_mtbf_hours": mtbf_s / 3600.0,
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_seconds": ckpt_s,
        "checkpoint_interval_s": interval,
        "expected_overhead": (ckpt_s / interval + interval / (2 * mtbf_s)) if interval else 0.0,
    }
