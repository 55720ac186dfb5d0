"""Launchers: dry (plan only), local (processes on this machine), slurm (submitit)."""
from __future__ import annotations

import sys
from pathlib import Path


def launch(plan, cfg, out_dir: Path) -> int:
    name = cfg.launcher.name
    if name == "dry":
        return 0
    if name == "local":
        from orchestrator.launch.failover import run_with_failover

        code = run_with_failover(cfg, plan, out_dir)
        if code:
            print(f"\nFAILED: every rank was stopped. Logs: {out_dir / 'logs'}", file=sys.stderr)
            return code
        print(f"\ndone: TensorBoard logs in {out_dir / 'tensorboard'}, "
              f"metrics in {out_dir / 'metrics.json'}, plan and pictures in {out_dir}")
        return 0
    if name == "slurm":
        from orchestrator.launch.slurm import launch_slurm

        return launch_slurm(plan, cfg, out_dir)
    print(f"launcher.name={name!r} is unknown: use dry, local or slurm.", file=sys.stderr)
    return 2
