"""The parallel axes: one entry each, read by the cost model, the report, the figures
and the runtime's meshes.

An axis names the grid its groups live in (dense or expert, plan/layout.py), the grid
axes its groups span, the collective it runs and whether that traffic can hide behind
computation. The order tokens are Megatron's (tp, cp, ep, dp, pp); `edp`, the expert
data-parallel axis, sits in dp's slot of the expert grid.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Axis:
    name: str
    grid: str  # "dense" or "expert"
    members: tuple[str, ...]  # the grid axes one group spans
    collective: str
    hideable: bool  # overlaps with computation (pipeline sends, gradient reduction)


AXES: dict[str, Axis] = {a.name: a for a in (
    Axis("tp", "dense", ("tp",), "all-reduce (AG+RS with SP)", False),
    Axis("cp", "dense", ("cp",), "all-gather K,V / reduce-scatter dK,dV", False),
    Axis("ep", "expert", ("ep",), "all-to-all", False),
    Axis("pp", "dense", ("pp",), "send/recv", True),
    # FSDP/ZeRO shards dense weights over data x context ranks, as torchtitan and Megatron do.
    Axis("dp", "dense", ("dp", "cp"), "all-gather + reduce-scatter", True),
    Axis("edp", "expert", ("edp",), "all-gather + reduce-scatter", True),
)}

CANONICAL_ORDER = ("tp", "cp", "ep", "pp", "dp")  # Meta's (Llama 3): tensor, context, pipeline, data

# The runtime's DeviceMesh dimensions, outermost first (torch's convention). The dense mesh
# splits dp into dpr (whole copies of the model state) x dps (the ranks that shard one copy,
# FSDP's group with cp): dp = dpr x dps, dps innermost.
MESH_DIMS = {"dense": ("pp", "dpr", "dps", "cp", "tp"), "expert": ("pp", "edp", "ep", "etp")}
FSDP_DIMS = {"dense": ("dps", "cp"), "expert": ("edp",)}
REPLICATE_DIMS = ("dpr",)
