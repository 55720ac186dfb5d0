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


def steps_completed(run_dir: Path, attempts) -> int:
    """Steps the given attempts completed (from rank 0's metrics.jsonl); 0 if none."""
    done = 0
    for rec in read_metrics(run_dir):
        if rec.get("attempt") in attempts:
            done = max(done, rec["step"] + 1)
    return done


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # a line being written
                continue
    return out
