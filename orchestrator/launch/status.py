"""status.json: where a run stands, in one small file the run-lifecycle commands read."""
from __future__ import annotations

import json
import time
from pathlib import Path

from orchestrator import rundir


def read_status(run_dir: Path) -> dict:
    try:
        status = json.loads((Path(run_dir) / rundir.STATUS_JSON).read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}  # another program's status.json says nothing here


def write_status(run_dir: Path, **fields) -> dict:
    """Merge `fields` into status.json (written whole, then renamed: readers never see half)."""
    run_dir = Path(run_dir)
    status = read_status(run_dir) | fields | {"updated": time.time()}
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.write_json(run_dir / rundir.STATUS_JSON, status, default=str)
    return status


def steps_completed(run_dir: Path, attempts) -> int:
    """Steps the given attempts completed (from rank 0's metrics.jsonl); 0 if none."""
    done = 0
    for rec in read_metrics(run_dir):
        if rec.get("attempt") in attempts and isinstance(rec.get("step"), int):
            done = max(done, rec["step"] + 1)
    return done


def read_metrics(run_dir: Path) -> list[dict]:
    """Every record of metrics.jsonl, as written (every attempt's; a line being written is skipped)."""
    return rundir.read_jsonl(Path(run_dir) / rundir.METRICS_JSONL)
