"""status.json: where a run stands, in one small file the run-lifecycle commands read."""
from __future__ import annotations

import json
import time
from pathlib import Path


def read_status(run_dir: Path) -> dict:
    try:
        return json.loads((Path(run_dir) / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def write_status(run_dir: Path, **fields) -> dict:
    """Merge `fields` into status.json (written whole, then renamed: readers never see half)."""
    run_dir = Path(run_dir)
    status = read_status(run_dir) | fields | {"updated": time.time()}
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f"status.json.{time.monotonic_ns()}.tmp"
    tmp.write_text(json.dumps(status, indent=1, default=str) + "\n")
    tmp.replace(run_dir / "status.json")
    return status
