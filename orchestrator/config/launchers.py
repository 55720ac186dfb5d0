"""Launcher settings: what every launcher shares, and each launcher's own group (as
hydra-submitit-launcher splits its queue configs), so a key that does not belong to the
chosen launcher fails at compose time."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING


class LauncherName(str, Enum):
    dry = "dry"
    local = "local"
    slurm = "slurm"


@dataclass
class LauncherConfig:
    """What every launcher shares."""

    name: LauncherName = MISSING
    job_name: str = "orchestrator"
    group_readable: bool = False  # the run directory, checkpoints and logs readable by the group (never writable)
    allow_other_owner: bool = False  # use a run or checkpoint directory that belongs to another user


@dataclass
class DryLauncherConfig(LauncherConfig):
    name: LauncherName = LauncherName.dry


@dataclass
class LocalLauncherConfig(LauncherConfig):
    """Processes on this machine, one per emulated GPU."""

    name: LauncherName = LauncherName.local


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """SLURM through submitit; every value that reaches sbatch is validated first."""

    name: LauncherName = LauncherName.slurm
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time_min: int = 60
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    # sbatch --switches=N[@max-wait]: at most N leaf switches (topology/tree), waiting up to
    # max-wait (minutes, or [days-]hours:minutes:seconds) before taking a wider allocation.
    switches: Optional[str] = None
    segment: Optional[int] = None  # sbatch --segment=N (topology/block): nodes per block-local segment
    setup: List[str] = field(default_factory=list)
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    wait: bool = False  # follow the job and print its progress; Ctrl-C detaches, never cancels
    submit: bool = True  # false: write and print the batch script and the srun line, submit nothing
    snapshot: bool = True  # the job runs a copy of the code taken at submission (RUN_DIR/code)
    container_image: Optional[str] = None  # pyxis/enroot image for the training steps (srun --container-image)
    container_mounts: List[str] = field(default_factory=list)  # SRC:DST[:FLAGS], as pyxis takes them
    container_workdir: Optional[str] = None
    # The interpreter inside the image (the host's venv path means nothing there); the run
    # directory (plan, snapshot of the code, checkpoints by default) is mounted at its own path.
    container_python: str = "python"
    cpus_per_task: int = 1
    gpus_per_node_gres: bool = True  # request --gpus-per-node (the GRES)
    signal_delay_s: int = 60  # SIGUSR2 this long before the time limit: save and requeue
    max_requeues: int = 3  # preemptions / time-outs before the job stops requeuing itself
    # How long a failed step's nodes are watched for going down before the failure is read as a
    # crashed rank on healthy nodes; None = SLURM's SlurmdTimeout + 30 s, at least 60 s
    node_fail_wait_s: Optional[float] = None
    poll_s: float = 2.0  # how often the supervisor looks at its step and its nodes


LAUNCHER_SCHEMAS = {LauncherName.dry: DryLauncherConfig, LauncherName.local: LocalLauncherConfig,
                    LauncherName.slurm: SlurmLauncherConfig}
