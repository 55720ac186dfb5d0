"""For your own training script (trainer=command): the plan of this attempt and a torch
DeviceMesh with the plan's groups. Importing this module does not import torch.

    from orchestrator import runtime
    plan = runtime.plan()                  # this attempt's plan.json (ORCH_PLAN)
    mesh = runtime.device_mesh()           # mesh["dp"], mesh["tp"], mesh["pp"], mesh["cp"]
    runtime.run_dir(), runtime.attempt()   # ORCH_RUN_DIR (every attempt's), ORCH_ATTEMPT

The mesh is built from the plan's explicit rank grid (orchestrator/train/mesh.py), so its
groups are the plan's groups whatever order the planner chose for the ranks. Every rank
calls device_mesh() together; it starts torch.distributed (gloo on CPU, NCCL on CUDA, from
the plan's hardware) from torchrun's environment when the script has not.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from orchestrator import rundir

DENSE = ("pp", "dp", "cp", "tp")  # outermost first; dp: every data-parallel rank
SPLIT = ("pp", "dpr", "dps", "cp", "tp")  # dp as whole copies (dpr) x the ranks sharding one (dps)


def plan() -> dict:
    """This attempt's plan.json, as the launcher wrote it (ORCH_PLAN)."""
    path = os.environ.get(rundir.ENV_PLAN)
    if not path:
        raise RuntimeError("ORCH_PLAN is not set: start this program with orchestrate trainer=command "
                           "trainer.command='...' (launcher=local or launcher=slurm).")
    return json.loads(Path(path).read_text())


def run_dir() -> Path:
    """The run directory, the same for every attempt (checkpoints and metrics go here)."""
    return Path(os.environ.get(rundir.ENV_RUN_DIR) or Path(os.environ[rundir.ENV_PLAN]).parent)


def attempt() -> int:
    return int(os.environ.get(rundir.ENV_ATTEMPT, "0"))


def device_mesh(dims: tuple[str, ...] | None = None, expert: bool = False):
    """A DeviceMesh of this rank's world with the plan's groups: dims DENSE (the default),
    SPLIT (HSDP's replicate x shard) or, with expert=True, the plan's expert grid
    (pp, edp, ep, etp)."""
    import torch.distributed as dist

    from orchestrator.train.mesh import grid_from_json, mesh_from_grid

    p = plan()
    device = p["config"]["hardware"]["device"]
    if not dist.is_initialized():
        dist.init_process_group("gloo" if device == "cpu" else "nccl")
    if expert:
        return mesh_from_grid(grid_from_json(p, "expert_ranks"), device, tuple(dims or p["mesh"]["expert"]))
    return mesh_from_grid(grid_from_json(p), device, tuple(dims or DENSE), p["layout"]["dp_shard"])
