"""The Plan of one layout: validate, inventory, rank order, cost. Torch-free.

The Plan is the contract between the planner, the launchers and the runtime:
`Plan.to_json()` is what `plan.json` holds (README, "Planning"), and the
runtime builds its process groups, model chunks and data split from it alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from orchestrator.config.compose import to_dict
from orchestrator.config.errors import PlanError, Problem
from orchestrator.config.schema import Config
from orchestrator.plan.axes import AXES, FSDP_DIMS, MESH_DIMS, REPLICATE_DIMS
from orchestrator.plan.cost import AxisReport, Step, auto_order, axis_traffic, step_time
from orchestrator.plan.inventory import Memory, inventory
import orchestrator.plan.timeouts as timeouts
from orchestrator.plan.judge import blast_radius, judge_cross_node_tp, judge_memory
from orchestrator.plan.layout import Layout
from orchestrator.plan.model import ModelMath
from orchestrator.plan.stages import build_stages
from orchestrator.plan.topology import RankGrid, Tier, tiers_for
from orchestrator.plan.uncertainty import attention_share, plan_interval
from orchestrator.plan.validate import check_order, validate


@dataclass
class Plan:
    valid: bool
    errors: list[Problem]
    warnings: list[str]
    world_size: int
    spec: Config | None  # None only when the config itself could not be read
    layout: Layout | None = None
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
    placement: Any = None  # plan/placement.py: on real hosts (cluster.topology, cluster.nodelist)
    # 80% interval of the MFU from leave-one-source-family-out residuals (plan/uncertainty.py)
    mfu_interval: list[float] | None = None
    mfu_interval_basis: str | None = None
    attention_share: float | None = None  # of the predicted step, in the attention kernel (its low end)
    # hardware=cpu (plan/machine.py): what the step is predicted with on this machine, and whether it
    # is a prediction for this layout (`is_prediction`; if not, `not_measured` says why)
    prediction: dict | None = None

    def grid(self) -> RankGrid:
        """The dense rank grid (tp, cp, dp, pp): every group of attention, dense MLPs and FSDP."""
        if not self.layout:
            raise PlanError(self.errors)
        return self.layout.dense_grid(self.order)

    def expert_grid(self) -> RankGrid:
        """The expert rank grid (etp, ep, edp, pp) over the same ranks."""
        if not self.layout:
            raise PlanError(self.errors)
        return self.layout.expert_grid(self.order)

    def raise_if_invalid(self) -> "Plan":
        if not self.valid:
            raise PlanError(self.errors)
        return self

    def to_json(self) -> dict:
        d = self.layout
        out: dict[str, Any] = {"valid": self.valid, "errors": [e.to_dict() for e in self.errors],
                               "warnings": self.warnings, "world_size": self.world_size}
        if self.spec is None:
            return out
        out.update(model={"name": self.spec.model.name, "params": self.params, "active_params": self.active_params},
                   hardware=self.spec.hardware.name, nodes=self.spec.cluster.nodes)
        if d:
            out["layout"] = d.to_json(self.order) | {"recompute": self.spec.training.recompute.value}
        if self.memory:
            out["memory"] = self.memory.to_json()
        if self.step:
            out["step"] = self.step.to_json()
            out.update(mfu=self.mfu, hfu=self.hfu, tflops_per_gpu=self.tflops_per_gpu,
                       tokens_per_s=self.tokens_per_s, model_flops_per_step=self.model_flops_per_step,
                       mfu_interval=self.mfu_interval, mfu_interval_basis=self.mfu_interval_basis,
                       attention_share=self.attention_share)
            out["axes"] = [a.to_json() for a in self.axes.values() if a.size > 1]
            out["ranks"] = self.grid().to_json()
            out["expert_ranks"] = self.expert_grid().to_json()
            # The runtime's meshes: which grid axes each DeviceMesh has and what FSDP shards over.
            out["mesh"] = {"dense": list(MESH_DIMS["dense"]), "expert": list(MESH_DIMS["expert"]),
                           "fsdp": list(FSDP_DIMS["dense"]), "expert_fsdp": list(FSDP_DIMS["expert"]),
                           "replicate": list(REPLICATE_DIMS), "data": "dp"}
            out["blast_radius"] = self.blast_radius
        if self.spec.published is not None:
            out["published"] = to_dict(self.spec.published)
        if self.prediction is not None:
            out["prediction"] = self.prediction
        if self.search:
            out["search"] = self.search
        if self.placement is not None:
            out["placement"] = self.placement.to_json()
        out["config"] = to_dict(self.spec)
        return out


def plan_spec(spec: Config, order_override: list[str] | None = None, mm: ModelMath | None = None) -> Plan:
    shaped = shape_plan(spec, order_override, mm)
    return shaped if isinstance(shaped, Plan) else cost_plan(shaped, spec)


@dataclass
class Shaped:
    """A layout placed on the machine: what the kernel and cost coefficients do not change
    (calibration fits those, re-costing the same shapes many times)."""

    layout: Layout
    order: list[str]
    stages: list
    axes: dict[str, AxisReport]
    tiers: dict[str, Tier]
    mm: ModelMath
    warnings: list[str]
    blast_radius: dict | None = None


def shape_plan(spec: Config, order_override: list[str] | None = None,
               mm: ModelMath | None = None) -> Shaped | Plan:
    """Validate, split into stages, count each axis' traffic and place it; a rejected Plan
    when the layout is invalid."""
    layout, problems, warnings = validate(spec)
    world = spec.cluster.nodes * spec.hardware.gpus_per_node
    if layout is None:
        return Plan(valid=False, errors=problems, warnings=list(warnings), world_size=world, spec=spec)
    mm = mm or ModelMath(spec.model)
    tr, hw = spec.training, spec.hardware
    stages = build_stages(mm, layout, tr.seq_len, tr.recompute, tr.flash_attention, spec.cost.attention_flops,
                          spec.stack.selective, tr.recompute_layers, tr.mtp_depth)
    axes = axis_traffic(stages, layout, mm, tr, hw, spec.layout.sequence_parallel, spec)
    order = order_override or layout.order or auto_order(axes, layout)
    problems = check_order(layout, order) if not layout.order else []  # a written order was checked already
    if problems:
        return Plan(valid=False, errors=problems, warnings=list(warnings), world_size=world, spec=spec)
    tiers = _place(axes, layout, order, spec)
    return Shaped(layout, order, stages, axes, tiers, mm, list(warnings))


def cost_plan(shaped: Shaped, spec: Config) -> Plan:
    """Step time, memory, MFU and the judgements of a shaped layout under `spec`: the shape's
    own spec, or one that differs from it only in kernel and cost coefficients."""
    layout, stages, mm = shaped.layout, shaped.stages, shaped.mm
    tr, hw = spec.training, spec.hardware
    world = spec.cluster.nodes * hw.gpus_per_node
    plan = Plan(valid=False, errors=[], warnings=list(shaped.warnings), world_size=world, spec=spec)
    plan.params, plan.active_params = mm.total_params, mm.active_params
    cost = step_time(stages, layout, mm, shaped.axes, shaped.tiers, shaped.order, spec)
    step, axes = cost.step, cost.reports(shaped.axes)
    memory = inventory(stages, layout, hw, tr, mm.V, spec)
    plan.layout, plan.order, plan.axes, plan.step, plan.memory = layout, shaped.order, axes, step, memory

    tokens = tr.global_batch * tr.seq_len
    model_flops = mm.model_flops_per_token(tr.seq_len, spec.cost.attention_flops) * tokens
    hw_flops = model_flops * sum(s.hw_flops_tok for s in stages) / max(sum(s.model_flops_tok for s in stages), 1e-30)
    peak = hw.peak_tflops * 1e12
    plan.model_flops_per_step = model_flops
    plan.mfu = model_flops / (world * peak * step.wall_s)
    plan.hfu = hw_flops / (world * peak * step.wall_s)
    plan.tflops_per_gpu = plan.mfu * hw.peak_tflops
    plan.tokens_per_s = tokens / step.wall_s
    plan.attention_share = attention_share(plan, stages, mm)
    iv = plan_interval(plan)
    if iv is not None:
        plan.mfu_interval, plan.mfu_interval_basis = [iv[0], iv[1]], iv[2]
    if shaped.blast_radius is None:
        shaped.blast_radius = blast_radius(plan, mm)
    t = timeouts.ladder(spec.failover, step.wall_s, shaped.blast_radius.get("checkpoint_seconds") or 0.0)
    t["collective_bound_s"] = timeouts.collective_bound_s(timeouts.cross_copy_s(list(axes.values())),
                                                          t["collective_s"], spec.failover)
    plan.blast_radius = {**shaped.blast_radius, "timeouts": t}
    plan.errors += timeouts.problems(spec.failover, t)
    plan.spec = replace(spec, failover=timeouts.resolved(spec.failover, t))  # the ladder the runtime reads
    judge_cross_node_tp(plan, tiers_for(spec))
    judge_memory(plan)
    plan.valid = not plan.errors
    return plan


def _place(axes: dict[str, AxisReport], layout: Layout, order: list[str], spec: Config) -> dict[str, Tier]:
    """The tier each axis' groups span on this order, written into its report."""
    grids = {"dense": layout.dense_grid(order), "expert": layout.expert_grid(order)}
    hw = spec.hardware
    tier_list = tiers_for(spec)
    tiers: dict[str, Tier] = {}
    for name, report in axes.items():
        axis = AXES[name]
        grid = grids[axis.grid]
        tier = grid.tier_of(axis.members, tier_list)
        tiers[name] = tier
        report.tier, report.gbps, report.latency_us = tier.name, tier.gbps, tier.latency_us
        size = 1
        for m in axis.members:
            size *= grid.sizes[m]
        report.groups = grid.world // size
        report.straddling_groups = int(grid.straddling(axis.members, hw.gpus_per_node).sum())
    return tiers
