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
    print(f"launcher={name} is not available yet in this version: the plan was written to {out_dir}; "
          f"use launcher=dry or launcher=local.", file=sys.stderr)
    return 2
