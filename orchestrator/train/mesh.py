"""The plan's rank grid -> a torch DeviceMesh built from an explicit rank tensor.

The mesh's dimensions are always named and ordered ("pp", "dp", "ep", "cp",
"tp"), torch's usual outermost-to-innermost, but the rank tensor is the plan's
grid transposed into that order, so every group is the plan's even when the
physical order (which axis owns consecutive ranks) differs from torch's.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh

from orchestrator.plan.topology import RankGrid

MESH_DIMS = ("pp", "dp", "ep", "cp", "tp")


def grid_from_json(plan_json: dict) -> RankGrid:
    ranks = plan_json["ranks"]
    return RankGrid(ranks["sizes"], ranks["order"])


def rank_tensor(grid: RankGrid, dims=MESH_DIMS) -> np.ndarray:
    """Ranks as an array indexed [pp, dp, ep, cp, tp] (or `dims`): entry = the rank there."""
    out = np.empty([grid.sizes[a] for a in dims], dtype=np.int64)
    for idx in np.ndindex(*out.shape):
        out[idx] = grid.rank(dict(zip(dims, idx)))
    return out


def mesh_from_grid(grid: RankGrid, device_type: str = "cpu", dims=MESH_DIMS) -> DeviceMesh:
    """Every rank calls this collectively; returns the DeviceMesh of the plan's groups."""
    mesh = torch.as_tensor(rank_tensor(grid, dims))
    return DeviceMesh(device_type, mesh, mesh_dim_names=tuple(dims))
