"""The launcher interface: how a planned run is started, followed and stopped.

A launcher receives the plan and the run directory. `submit` does what the launcher
is for: dry stops after the plan, local runs the ranks here and supervises them to
the end, slurm hands the run to a supervisor inside the allocation. Implementations
are looked up by name (`launcher.name`) and imported lazily, so planning never pays
for submitit.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path

from orchestrator.config.errors import Problem

LAUNCHERS = {
    "dry": "orchestrator.launch.dry:DryLauncher",
    "local": "orchestrator.launch.local:LocalLauncher",
    "slurm": "orchestrator.launch.slurm:SlurmLauncher",
}


class Launcher(ABC):
    def __init__(self, plan, run_dir: Path, argv: list[str] | None = None):
        self.plan, self.spec, self.run_dir = plan, plan.spec, Path(run_dir)
        self.argv = list(argv or [])

    def preflight(self) -> list[Problem]:
        """Problems found before anything is started or submitted (nothing is written)."""
        import sys

        from orchestrator.launch.preflight import preflight
        from orchestrator.frameworks.trainers import placement_problems, release_problems

        lc = self.spec.launcher  # the interpreter that starts the ranks: the image's in a container
        python = lc.container_python if getattr(lc, "container_image", None) else sys.executable
        return placement_problems(self.plan) + release_problems(self.plan, python) + preflight(self.spec, self.run_dir)

    @abstractmethod
    def submit(self) -> int:
        """Start the run; returns the process exit status (0 ok, 1 the job failed)."""


def launcher_for(plan, run_dir: Path, argv: list[str] | None = None) -> Launcher:
    module, cls = LAUNCHERS[plan.spec.launcher.name.value].split(":")
    return getattr(importlib.import_module(module), cls)(plan, run_dir, argv)
