"""Starting the ranks of an external trainer (trainer=torchtitan, megatron, command): the one
place that builds a rank's argv and environment, for the local launcher and for srun.

Every rank runs the same command line (frameworks/trainers.py renders it from this attempt's
plan.json) with torchrun's environment: RANK (placed so the framework's own groups are the
plan's, frameworks/trainers.rank_map), LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the
node's index), MASTER_ADDR, MASTER_PORT, plus ORCH_PLAN (this attempt's plan.json),
ORCH_RUN_DIR (the run directory, the same for every attempt) and ORCH_ATTEMPT, and what the
framework needs there (frameworks/trainers.env: Megatron-LM's CUDA_DEVICE_MAX_CONNECTIONS, set
or removed). A leading
`python` (or `python3`) word is the interpreter that starts the rank: the launcher's here,
the image's under srun in a container (launcher.container_python).

Under srun each task runs `python -m orchestrator.launch.trainers PLAN_DIR -- ARGV...`,
which sets that environment from SLURM's (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID,
SLURM_NTASKS) and replaces itself with the trainer (exec): signals reach the trainer.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from orchestrator import rundir
from orchestrator.launch.processes import LocalJob, apply
from orchestrator.frameworks.trainers import argv as render_argv
from orchestrator.frameworks.trainers import env as framework_env
from orchestrator.frameworks.trainers import external, files, rank_map

PYTHONS = ("python", "python3")


def _plan(plan_dir: Path) -> dict:
    return json.loads((Path(plan_dir) / rundir.PLAN_JSON).read_text())


def prepare(plan_dir: Path) -> list[str]:
    """This attempt's command line, and the files it names (frameworks/trainers.files) written beside its plan."""
    pj = _plan(plan_dir)
    for name, text in files(pj).items():
        (Path(plan_dir) / name).write_text(text)
    return render_argv(pj, Path(plan_dir))


def program(plan_dir: Path, python: str) -> list[str]:
    """What each srun task runs: the built-in worker, or this module wrapping the trainer."""
    plan_dir = Path(plan_dir)
    try:
        builtin = not external(_plan(plan_dir))
    except (OSError, ValueError, KeyError):  # no plan yet: the built-in worker reads it when it starts
        builtin = True
    if builtin:
        return [python, "-m", "orchestrator.train.worker", str(plan_dir)]
    return [python, "-m", "orchestrator.launch.trainers", str(plan_dir), "--", *prepare(plan_dir)]


def rank_env(plan_dir: Path, position: int, world: int) -> dict[str, str | None]:
    """The variables a rank adds to torchrun's (the caller sets LOCAL_*, GROUP_RANK, MASTER_*);
    None: a variable the rank's environment must not hold."""
    pj = _plan(plan_dir)
    return {**framework_env(pj), "RANK": str(rank_map(pj)[position]), "WORLD_SIZE": str(world),
            rundir.ENV_PLAN: str(Path(plan_dir) / rundir.PLAN_JSON)}


def task_env(plan_dir: Path, node: int, local: int, per_node: int, world: int) -> dict[str, str | None]:
    """What an srun task sets for itself before it becomes the trainer (main)."""
    return {**rank_env(plan_dir, node * per_node + local, world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(node)}


def describe_task_env(plan_dir: Path, per_node: int, world: int) -> list[str]:
    """task_env as the preview prints it: each variable once, with its rule where it varies."""
    if not external(_plan(plan_dir)):
        return ["(the built-in worker takes its rank from SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and ORCH_HOSTS: "
                "train/worker.py)"]
    ranks = rank_map(_plan(plan_dir))
    shown = "; ".join(f"node {n + 1}: {' '.join(map(str, ranks[n * per_node:(n + 1) * per_node]))}"
                      for n in range(min(2, world // per_node)))
    out = []
    for k, v in task_env(plan_dir, 0, 0, per_node, world).items():
        if k == "RANK":
            same = ranks == list(range(world))
            out.append(f"RANK=the rank placed on GPU SLURM_NODEID x {per_node} + SLURM_LOCALID "
                       f"({'the same number' if same else 'frameworks/trainers.rank_map'}: {shown}"
                       f"{' ...' if world > 2 * per_node else ''})")
        elif k in ("LOCAL_RANK", "GROUP_RANK"):
            out.append(f"{k}=$SLURM_{'LOCALID' if k == 'LOCAL_RANK' else 'NODEID'}")
        else:
            out.append(f"{k}={v}" if v is not None else f"{k} removed (unset)")
    return out


def resolved(words: list[str]) -> list[str]:
    return [sys.executable, *words[1:]] if words and words[0] in PYTHONS else list(words)


class TrainerJob(LocalJob):
    """An attempt's ranks on this machine, each running the trainer's command line."""

    def __init__(self, run_dir: Path, nodes: int, gpus_per_node: int, env: dict | None = None, echo: bool = True):
        super().__init__(run_dir, nodes, gpus_per_node, env, echo, worker=resolved(prepare(run_dir)))

    def start(self) -> None:
        from orchestrator.launch.processes import free_port

        self.port = free_port()
        self.nodes_of, self.names = [], []  # as LocalJob.start: each process's node and log name
        (self.run_dir / rundir.LOGS).mkdir(parents=True, exist_ok=True)
        for slot in range(self.world):
            env = rank_env(self.run_dir, slot, self.world)
            self.spawn(slot, slot // self.gpn, env, f"rank{env['RANK']}")


def local_job(plan_dir: Path, **kw) -> LocalJob:
    """The local launcher's job for this attempt: the built-in runtime's or the trainer's."""
    return TrainerJob(plan_dir, **kw) if external(_plan(plan_dir)) else LocalJob(plan_dir, **kw)


def main() -> None:
    """An srun task: torchrun's environment from SLURM's, then exec the trainer."""
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--":
        raise SystemExit("usage: python -m orchestrator.launch.trainers PLAN_DIR -- PROGRAM [ARGS...]")
    plan_dir, words = Path(args[0]), resolved(args[2:])
    e = os.environ
    world, local = int(e["SLURM_NTASKS"]), int(e["SLURM_LOCALID"])
    per_node = world // int(e.get("SLURM_NNODES", e.get("SLURM_JOB_NUM_NODES", "1")))
    apply(e, task_env(plan_dir, int(e["SLURM_NODEID"]), local, per_node, world))
    os.execvp(words[0], words)


if __name__ == "__main__":
    main()
