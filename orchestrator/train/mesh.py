"""The plan's rank grids -> torch DeviceMeshes built from explicit rank tensors.

A mesh's dimensions are named and ordered as plan.json's "mesh" section says (torch's
usual outermost-to-innermost, e.g. pp, dp, cp, tp), but the rank tensor is the plan's
grid transposed into that order, so every group is the plan's even when the physical
order (which axis owns consecutive ranks) differs from torch's.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from orchestrator.plan.axes import MESH_DIMS
from orchestrator.plan.topology import RankGrid
from orchestrator.rundir.plan import RunPlan

DENSE_DIMS = MESH_DIMS["dense"]


def grid_from_json(plan: RunPlan | dict, key: str = "ranks") -> RankGrid:
    """The plan's dense rank grid ("ranks") or its expert grid ("expert_ranks")."""
    if key not in ("ranks", "expert_ranks"):
        raise KeyError(key)
    ranks = RunPlan.of(plan).grid(expert=key == "expert_ranks")
    return RankGrid(ranks["sizes"], ranks["order"])


def rank_tensor(grid: RankGrid, dims=DENSE_DIMS, dp_shard: int | None = None) -> np.ndarray:
    """Ranks as an array indexed by `dims` (e.g. [pp, dpr, dps, cp, tp]): entry = the rank there.
    The grid's dp axis splits into dpr x dps (dp = r * dp_shard + s); grid axes not in `dims`
    must have size 1."""
    split = "dpr" in dims and "dps" in dims
    plain = [d for d in dims if d not in ("dpr", "dps")] + (["dp"] if split else [])
    cube_axes = list(reversed(grid.order))  # the grid's cube is indexed outermost axis first
    extra = [a for a in cube_axes if a not in plain]
    assert all(grid.sizes[a] == 1 for a in extra), f"axes {extra} are not in the mesh {dims}"
    cube = grid.ranks_cube().squeeze(axis=tuple(cube_axes.index(a) for a in extra))
    kept = [a for a in cube_axes if a in plain]
    out = np.transpose(cube, [kept.index(a) for a in plain])  # indexed [...others, dp]
    if split:
        shard = dp_shard or grid.sizes["dp"]
        out = out.reshape(*out.shape[:-1], grid.sizes["dp"] // shard, shard)  # [..., dpr, dps]
        names = plain[:-1] + ["dpr", "dps"]
        out = np.transpose(out, [names.index(d) for d in dims])
    return out


def mesh_from_grid(grid: RankGrid, device_type: str = "cpu", dims=DENSE_DIMS, dp_shard: int | None = None) -> DeviceMesh:
    """Every rank calls this collectively; returns the DeviceMesh of the plan's groups."""
    mesh = torch.as_tensor(rank_tensor(grid, dims, dp_shard))
    return DeviceMesh(device_type, mesh, mesh_dim_names=tuple(dims))


def meshes_from_plan(plan: RunPlan | dict, device_type: str) -> dict[str, DeviceMesh]:
    """The dense mesh, and the expert mesh when the model has experts (their EP and edp groups)."""
    plan = RunPlan.of(plan)
    out = {"dense": mesh_from_grid(grid_from_json(plan, "ranks"), device_type, plan.mesh["dense"],
                                   plan.layout["dp_shard"])}
    if plan.config.model.moe.experts:
        out["expert"] = mesh_from_grid(grid_from_json(plan, "expert_ranks"), device_type, plan.mesh["expert"])
    return out
