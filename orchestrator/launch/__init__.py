"""Launchers: dry (plan only), local (processes on this machine), slurm (submitit)."""
from __future__ import annotations

import sys
from pathlib import Path


def launch(plan, cfg, out_dir: Path) -> int:
    name = cfg.launcher.name
    if name == "dry":
        return 0
    print(f"launcher={name} is not available yet in this version: the plan was written to {out_dir}; "
          f"use launcher=dry.", file=sys.stderr)
    return 2
