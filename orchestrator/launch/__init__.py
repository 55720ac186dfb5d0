"""Launchers: dry (plan only), local (processes on this machine), slurm (submitit)."""
from __future__ import annotations

import sys
from pathlib import Path


def launch(plan, cfg, out_dir: Path) -> int:
    name = cfg.launcher.name
    if name == "dry":
        return 0
    if name == "local":
        from orchestrator.launch.local import run_local

        res = run_local(out_dir, cfg.cluster.nodes, cfg.hardware.gpus_per_node)
        if not res.ok:
            print(f"\nFAILED: {res.cause}; every rank was stopped. Logs: {out_dir / 'logs'}", file=sys.stderr)
            return 1
        print(f"\ndone in {res.seconds:.1f} s: TensorBoard logs in {out_dir / 'tensorboard'}, "
              f"metrics in {out_dir / 'metrics.json'}, plan and pictures in {out_dir}")
        return 0
    print(f"launcher={name} is not available yet in this version: the plan was written to {out_dir}; "
          f"use launcher=dry or launcher=local.", file=sys.stderr)
    return 2
