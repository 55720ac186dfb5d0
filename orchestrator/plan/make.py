"""make_plan(cfg) -> Plan: the planner's one entry point (a layout as given, or the search)."""
from __future__ import annotations

from typing import Any

from orchestrator.config.compose import typed
from orchestrator.config.errors import ConfigError
from orchestrator.config.schema import LauncherName
from orchestrator.plan.capability import runtime_problems
from orchestrator.plan.placement import attach
from orchestrator.plan.plan import Plan, plan_spec
from orchestrator.plan.goodput import snapshot_every
from orchestrator.plan.replan import after_node_loss
from orchestrator.plan.search import search
from orchestrator.plan.validate import check_values
from orchestrator.plan.machine import on_this_machine


def make_plan(cfg: Any) -> Plan:
    """Plan a configuration (a composed DictConfig, a `Config` or a plain dict).

    Never raises for a bad configuration: the Plan comes back with `valid=False` and
    every problem in `errors`. Call `plan.raise_if_invalid()` to get a PlanError.
    """
    try:
        spec = typed(cfg)
    except ConfigError as e:
        return Plan(valid=False, errors=e.problems, warnings=[], world_size=0, spec=None)
    spec, machine = on_this_machine(spec)  # hardware=cpu: this machine's measured model, or None
    problems = check_values(spec)
    if problems:  # nothing below may run on numbers outside their physical range
        return Plan(valid=False, errors=problems, warnings=[], world_size=0, spec=spec)
    plan = search(spec) if spec.layout.search else plan_spec(spec)
    if machine is not None:  # whether its step is a prediction for this layout here, and why not
        plan.prediction = machine.judge(plan.layout)
        if plan.valid and plan.step is not None:  # the same layout under each of the probe's repeats
            from dataclasses import replace

            from orchestrator.plan.overheads import paid_terms

            again = [plan_spec(replace(plan.spec, hardware=hw)) for hw in machine.repeat_hardware(plan.spec.hardware)]
            plan.prediction = machine.spread(plan.prediction, plan.step.wall_s,
                                             [p.step.wall_s for p in again if p.step is not None], paid_terms(plan.layout))
        plan.warnings.append(machine.line(plan.prediction, plan.step.core_share if plan.step else 1.0))
    if plan.valid:
        attach(plan)  # cluster.topology / cluster.nodelist: the plan on those hosts
    if plan.layout is not None and spec.launcher.name != LauncherName.dry:
        plan.errors += runtime_problems(spec, plan.layout)
        plan.valid = not plan.errors
    if plan.valid and plan.blast_radius is not None:  # what one node lost costs, before anything runs
        plan.blast_radius = {**plan.blast_radius, "after_node_loss": after_node_loss(plan),
                             "snapshot": snapshot_every(plan)}
    return plan
