"""Where this rank stands: its coordinates in the plan, and the torch world it trains in.

With one copy of the model state (layout.dp_shard = dp, the default) the world is the
whole job, started the usual way (RANK, WORLD_SIZE, MASTER_ADDR), and the meshes are the
plan's grids. With several copies each copy is its own torch world, initialised through
the job's store (ORCH_STORE; its copy's shard) under its own prefix, with a mesh over its own ranks
(pp, dps, cp, tp); what crosses copies belongs to train/replicas.py. On a GPU the groups
carry host scalars over a cpu:gloo side backend (`backend_for`, `host_reduce`).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from orchestrator import rundir
from orchestrator.rundir.plan import RunPlan
from orchestrator.train.mesh import grid_from_json, meshes_from_plan

COPY_DIMS = ("pp", "dps", "cp", "tp")


@dataclass
class Place:
    copy: int  # which copy of the state (initially its dpr coordinate; spares come after)
    local: int  # rank inside its copy's world
    coords: dict  # pp, dps, cp, tp (and the plan's dp, tp, ... when it has a global rank)


def copy_shape(lay) -> tuple[int, ...]:
    """A copy's mesh shape (pp, dps, cp, tp) from the plan's layout section."""
    return (lay["pp"], lay["dp_shard"], lay["cp"], lay["tp"])


def place_of(plan: RunPlan, rank: int) -> Place:
    """A rank of the plan: its copy and its rank inside the copy (mixed radix over pp, dps, cp, tp)."""
    lay = plan.layout
    c = grid_from_json(plan).coords(rank)
    c["dps"] = c["dp"] % lay["dp_shard"]
    local = int(np.ravel_multi_index([c["pp"], c["dps"], c["cp"], c["tp"]], copy_shape(lay)))
    return Place(c["dp"] // lay["dp_shard"], local, c)


def spare_place(plan: RunPlan, copy: int, local: int) -> Place:
    """A spare copy's rank: its position inside a copy; its data place comes with admission."""
    pp, dps, cp, tp = (int(x) for x in np.unravel_index(local, copy_shape(plan.layout)))
    return Place(copy, local, {"pp": pp, "dps": dps, "cp": cp, "tp": tp, "ep": 0})


def copies_of(plan: RunPlan) -> int:
    return plan.layout["dp_replicate"]


def init(plan: RunPlan, backend: str, device_type: str, place: Place | None, store) -> dict[str, DeviceMesh]:
    """Initialise the torch world and build the meshes: the plan's, or the copy's own."""
    backend = backend_for(backend, device_type)
    if store is None:
        if not dist.is_initialized():
            dist.init_process_group(backend)
        return meshes_from_plan(plan, device_type)
    size = int(np.prod(copy_shape(plan.layout)))
    dist.init_process_group(backend, store=dist.PrefixStore(f"copy{place.copy}", store.for_copy(place.copy)),
                            rank=place.local, world_size=size)
    mesh = torch.arange(size).reshape(copy_shape(plan.layout))
    return {"dense": DeviceMesh(device_type, mesh, mesh_dim_names=COPY_DIMS)}


def backend_for(backend: str, device_type: str) -> str:
    """The process groups' backends: on a GPU the configured one (NCCL) serves device tensors and
    a cpu:gloo side backend the host scalars (loss, stop flag, memory, the copies' agreement), as
    torchtitan does; NCCL alone refuses CPU tensors. On the CPU the configured one (gloo)."""
    if device_type == "cuda" and backend != "gloo":
        return f"cuda:{backend},cpu:gloo"
    return backend


def host_reduce(values: list[float], op=dist.ReduceOp.SUM, group=None) -> list[float]:
    """Reduce host scalars over `group` (default: this world) in host memory: the side backend's."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op, group=group)
    return t.tolist()


def host_gather(values: list[float], group=None) -> list[list[float]]:
    """Every rank's host scalars, in rank order."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [x.tolist() for x in out]


def env_store():
    """The job's store (its shards: train/replicas.JobStores), when the launcher runs one (several
    copies of the state)."""
    addr = os.environ.get(rundir.ENV_STORE)
    if not addr:
        return None
    from orchestrator.train.replicas import JobStores

    return JobStores(addr)


def world_rank(plan: RunPlan, index: int, coords: dict) -> int:
    """The global rank (in `plan`) of the rank at `coords` in the copy at data index `index`."""
    dps = plan.layout["dp_shard"]
    return grid_from_json(plan).rank({"pp": coords["pp"], "dp": index * dps + coords["dps"], "cp": coords["cp"],
                                      "tp": coords["tp"], "ep": 0})


_beat_file: list = []  # this process's beat file, once it wrote one


def beat(run_dir: Path, step: int, phase: str, rank: int = -1) -> None:
    """This rank's progress, for the launcher's deadline (launch/progress.py reads it): a file in
    the shared run directory, named by host and pid (pids repeat across hosts), holding the
    step, phase, time, pid, global rank, host and SLURM task (its log: rank%t.log)."""
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    d = Path(run_dir) / rundir.PROGRESS
    d.mkdir(exist_ok=True)
    path = d / f"{host}.{os.getpid()}"
    path.write_text(f"{step} {phase} {time.time()} {os.getpid()} {rank} {host} {os.environ.get('SLURM_PROCID', -1)}")
    _beat_file[:] = [path]


PEER_ERRORS = ("closed by peer", "reset by peer", "Broken pipe", "Timed out", "timed out", "aborted by the coordinator")


def crashed_beat(error: BaseException, run_dir: Path | None = None) -> None:
    """This rank ends with an error: its beat says so at once (phase `crashed` when the error is its
    own, `peer` when it is a peer's failure seen: a connection closed or reset, a timeout), so a
    supervisor that sees only the beats (SLURM) stops the step now instead of letting its peers
    wait out their collective timeout (launch/progress.crashed). A rank that fails before its first
    beat (its rendezvous, its plan) writes one now, in `run_dir`, at step 0: else nobody sees it and
    its peers wait in the rendezvous until the store's timeout."""
    text = str(error)
    phase = "peer" if any(p in text for p in PEER_ERRORS) else "crashed"
    if not _beat_file and run_dir is not None:
        try:
            beat(run_dir, 0, phase, int(os.environ.get("RANK", -1)))
        except (OSError, ValueError):
            pass
        return
    for path in _beat_file:
        try:
            fields = path.read_text().split()
            fields[1], fields[2] = phase, repr(time.time())
            path.write_text(" ".join(fields))
        except (OSError, IndexError):
            pass


def forget_beat() -> None:
    """A rank that ended well (finished, or dismissed from the run) is no longer watched."""
    for path in _beat_file:
        try:
            os.unlink(path)
        except OSError:
            pass
