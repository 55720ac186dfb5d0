"""Per-rank progress deadlines: what notices a hang.

Each rank touches RUN_DIR/progress/<pid> as it begins and ends every step (train/world.py
`beat`). The launcher reads them for its live ranks: when no rank has made progress for
the deadline, the rank furthest behind (the lowest step and phase, the oldest beat) is the
hung one: it is named, its every thread's Python stack is dumped into its log (SIGUSR1,
faulthandler; train/worker.py) and its node is treated as lost. The deadline comes from the
plan: `failover.progress_deadline_s`, or DEADLINE_FACTOR x (predicted step + checkpoint
save), at least DEADLINE_FLOOR_S; it sits below the cross-copy collective timeout
(failover.timeout_s; the ladder and its checks: plan/timeouts.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from orchestrator.plan.timeouts import DEADLINE_FACTOR, DEADLINE_FLOOR_S, detection_s  # noqa: F401


def deadline_s(plan: dict, fo) -> float:
    """How long the job may go without any rank making progress (plan: a plan.json dict;
    plan/timeouts.detection_s)."""
    return detection_s(float(plan.get("step", {}).get("wall_s") or 0.0),
                       float((plan.get("blast_radius") or {}).get("checkpoint_seconds") or 0.0), fo)


@dataclass
class Beat:
    pid: int
    step: int
    ended: bool  # the step's end (else its beginning)
    time: float


def read(run_dir: Path, pids) -> dict[int, Beat]:
    """The last beat of each of `pids` that wrote one."""
    out = {}
    for pid in pids:
        try:
            step, phase, t = (Path(run_dir) / "progress" / str(pid)).read_text().split()
            out[pid] = Beat(pid, int(step), phase == "end", float(t))
        except (OSError, ValueError):
            continue
    return out


def hung(beats: dict[int, Beat], now: float, deadline: float) -> Beat | None:
    """The rank furthest behind, once no rank made progress for `deadline` seconds."""
    if not beats or now - max(b.time for b in beats.values()) < deadline:
        return None
    return min(beats.values(), key=lambda b: (b.step, b.ended, b.time))


def clear(run_dir: Path) -> None:
    """Forget the beats of an attempt that ended (their pids are gone)."""
    d = Path(run_dir) / "progress"
    for f in d.glob("*") if d.exists() else ():
        try:
            os.unlink(f)
        except OSError:
            pass
