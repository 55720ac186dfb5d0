"""An attempt's plan.json as the runtime reads it: one typed object, read in one place.

The trainer and everything it builds (world, meshes, model parts, pipeline schedule, expert
steps) take a `RunPlan`, never the file's dicts: the config comes typed (the same `typed()`
the planner uses), the layout-shaped sections (`layout`, `ranks`, `expert_ranks`, `mesh`) as
plan.json names them, and the planner's predictions the trainer logs next to its measures.
Fault injection (fault.*) is read from the typed config too (`fault_step`): plan.json holds
every fault setting, so nothing about it travels by environment. Torch-free; besides rundir
it reads only orchestrator.config (the schema), never the planner.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from orchestrator import rundir


@dataclass(frozen=True)
class RunPlan:
    layout: Mapping[str, Any]  # tp, cp, pp, dp, dp_shard, dp_replicate, ep, edp, stages, microbatches, ...
    world_size: int
    ranks: Mapping[str, Any]  # the dense rank grid: sizes, order
    expert_ranks: Mapping[str, Any] | None  # the expert grid (pp, edp, ep, etp), when the plan has one
    mesh: Mapping[str, Any]  # the mesh dimensions: dense, expert, fsdp, data
    config_json: Mapping[str, Any]  # the config as plan.json holds it (what a checkpoint records)
    predicted_tflops_per_gpu: float | None = None
    predicted_mfu: float | None = None
    predicted_step_s: float | None = None  # step.wall_s
    axes: tuple = ()  # the planner's per-axis reports (name, bytes_per_step, ...)
    path: Path | None = field(default=None, compare=False)  # the plan.json read (None: built from a dict)
    data: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)  # the whole file

    # ---- reading ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: Path | str) -> RunPlan:
        """The plan at `path`: a plan.json, or the (attempt) directory holding one."""
        path = Path(path)
        if path.is_dir():
            path = path / rundir.PLAN_JSON
        return cls.from_json(json.loads(path.read_text()), path)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], path: Path | None = None) -> RunPlan:
        """The plan from plan.json's contents (a KeyError names a section it lacks)."""
        step = data.get("step") or {}
        return cls(layout=data["layout"], world_size=int(data["world_size"]), ranks=data["ranks"],
                   expert_ranks=data.get("expert_ranks"), mesh=data["mesh"], config_json=data["config"],
                   predicted_tflops_per_gpu=data.get("tflops_per_gpu"), predicted_mfu=data.get("mfu"),
                   predicted_step_s=step.get("wall_s"), axes=tuple(data.get("axes") or ()), path=path, data=data)

    @classmethod
    def of(cls, plan: RunPlan | Mapping[str, Any] | Path | str) -> RunPlan:
        """A RunPlan from what a caller holds: one already, plan.json's contents, or its path."""
        if isinstance(plan, RunPlan):
            return plan
        if isinstance(plan, Mapping):
            return cls.from_json(plan)
        return cls.load(plan)

    # ---- typed views --------------------------------------------------------------------------
    @cached_property
    def config(self):
        """The typed config (orchestrator.config.schema.Config), checked as the planner checks it."""
        from orchestrator.config.compose import typed  # (omegaconf: only when the config is read)

        return typed(self.config_json)

    @property
    def label(self) -> str:
        return self.layout["label"]

    def grid(self, expert: bool = False) -> Mapping[str, Any]:
        """The dense rank grid, or the expert one (sizes, order)."""
        return self.expert_ranks if expert else self.ranks

    def axis(self, name: str) -> Mapping[str, Any] | None:
        """The planner's report of one parallel axis (e.g. "ep": its predicted bytes_per_step)."""
        return next((a for a in self.axes if a.get("name") == name), None)

    @property
    def fault_step(self) -> int | None:
        return fault_step(self.config)


def fault_step(spec) -> int | None:
    """The step fault injection (fault.*) fires after, from the typed config; None: no fault.
    A node kind (kill_node, slow_node) is armed by fault.kill_node, a rank kind by fault.rank;
    fault.mode=random draws the step from fault.seed (the same on every process that asks)."""
    from orchestrator.config.schema import FaultKind, FaultMode

    f = spec.fault
    armed = bool(f.nodes()) if f.kind in (FaultKind.kill_node, FaultKind.slow_node) else f.rank is not None
    if not armed:
        return None
    if f.mode == FaultMode.random:
        return random.Random(f.seed).randint(1, max(spec.training.steps - 1, 1))
    return f.at_step
