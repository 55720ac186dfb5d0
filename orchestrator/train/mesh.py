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

DENSE_DIMS = MESH_DIMS["dense"]


def grid_from_json(plan_json: dict, key: str = "ranks") -> RankGrid:
    ranks = plan_json[key]
    return RankGrid(ranks["sizes"], ranks["order"])


def rank_tensor(grid: RankGrid, dims=DENSE_DIMS) -> np.ndarray:
    """Ranks as an array indexed by `dims` (e.g. [pp, dp, cp, tp]): entry = the rank there.
    Grid axes not in `dims` must have size 1."""
    cube_axes = list(reversed(grid.order))  # the grid's cube is indexed outermost axis first
    extra = [a for a in cube_axes if a not in dims]
    assert all(grid.sizes[a] == 1 for a in extra), f"axes {extra} are not in the mesh {dims}"
    cube = grid.ranks_cube().squeeze(axis=tuple(cube_axes.index(a) for a in extra))
    kept = [a for a in cube_axes if a in dims]
    return np.transpose(cube, [kept.index(a) for a in dims])


def mesh_from_grid(grid: RankGrid, device_type: str = "cpu", dims=DENSE_DIMS) -> DeviceMesh:
    """Every rank calls this collectively; returns the DeviceMesh of the plan's groups."""
    mesh = torch.as_tensor(rank_tensor(grid, dims))
    return DeviceMesh(device_type, mesh, mesh_dim_names=tuple(dims))


def meshes_from_plan(plan_json: dict, device_type: str) -> dict[str, DeviceMesh]:
    """The dense mesh, and the expert mesh when the plan has expert parallelism."""
    out = {"dense": mesh_from_grid(grid_from_json(plan_json, "ranks"), device_type, plan_json["mesh"]["dense"])}
    if plan_json["layout"]["ep"] > 1:
        out["expert"] = mesh_from_grid(grid_from_json(plan_json, "expert_ranks"), device_type,
                                       plan_json["mesh"]["expert"])
    return out
