"""Per-rank progress deadlines: what notices a hang.

Each rank touches RUN_DIR/progress/<host>.<pid> as it begins and ends every step (train/world.py
`beat`). The launcher reads them for its live ranks (the local one by pid; under SLURM the
supervisor reads every beat in the shared run directory, `watch`): when no rank has made progress for
the deadline, the rank furthest behind (the lowest step and phase, the oldest beat) is the
hung one: it is named, its every thread's Python stack is dumped into its log (SIGUSR1,
faulthandler; train/worker.py) and its node is treated as lost. The deadline comes from the
plan: `failover.progress_deadline_s`, or DEADLINE_FACTOR x (predicted step + checkpoint
save), at least DEADLINE_FLOOR_S; it sits below the cross-copy collective timeout
(failover.timeout_s; the ladder and its checks: plan/timeouts.py), so a hang is named before a
collective times out on it. A straggler (launch/stragglers.py) is not a hang: it beats every
step, so only a step longer than the deadline reads as one.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from orchestrator import rundir
from orchestrator.plan.timeouts import detection_s


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
    rank: int = -1  # the global rank in its attempt's plan
    host: str = ""  # the host it runs on (SLURMD_NODENAME under SLURM)
    task: int = -1  # its SLURM task id (its log is rank<task>.log); -1 outside SLURM


def read(run_dir: Path, pids=None) -> dict[int, Beat]:
    """The last beat of every rank that wrote one (of `pids` only, when given), by pid; the
    ranks write them in the run directory, so a supervisor on another node reads them too."""
    d = Path(run_dir) / rundir.PROGRESS
    out = {}
    for f in d.glob("*") if d.exists() else ():
        try:
            step, phase, t, pid, rank, host, task = f.read_text().split()
            b = Beat(int(pid), int(step), phase == "end", float(t), int(rank), host, int(task))
        except (OSError, ValueError):  # gone, or being written
            continue
        if pids is None or b.pid in pids:
            out[b.pid] = b
    return out


def hung(beats: dict[int, Beat], now: float, deadline: float) -> Beat | None:
    """The rank furthest behind, once no rank made progress for `deadline` seconds."""
    if not beats or now - max(b.time for b in beats.values()) < deadline:
        return None
    return min(beats.values(), key=lambda b: (b.step, b.ended, b.time))


def watch(run_dir: Path, deadline: float, lost=(), now: float | None = None) -> Beat | None:
    """The hung rank, for a supervisor that sees only the beats (SLURM: the ranks run on other
    nodes): every beat but those of hosts already lost (their ranks died with them; a rank that
    ended well removed its own), furthest behind once none made progress for `deadline`."""
    beats = {p: b for p, b in read(run_dir).items() if b.host not in lost}
    return hung(beats, time.time() if now is None else now, deadline)


def verdict(beat: Beat, who: str, node, now: float, deadline: float, log: str) -> str:
    """What the console, status and failover.json say of a hung rank."""
    return (f"{who} (pid {beat.pid}) on node {node} hung: no rank made progress for {now - beat.time:.1f} s, "
            f"past the deadline of {deadline:.0f} s, and it is furthest behind (step {beat.step + 1} "
            f"{'ended' if beat.ended else 'begun'}); its Python stack is in {log}; node {node} treated as lost")


def clear(run_dir: Path) -> None:
    """Forget the beats of an attempt that ended (their pids are gone)."""
    d = Path(run_dir) / rundir.PROGRESS
    for f in d.glob("*") if d.exists() else ():
        try:
            os.unlink(f)
        except OSError:
            pass
