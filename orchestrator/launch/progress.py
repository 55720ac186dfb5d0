"""Per-rank progress deadlines: what notices a hang.

Each rank touches RUN_DIR/progress/<host>.<pid> as it begins every step, as it enters the
cross-copy collective (phase `wait`: from there on it waits on the other copies) and as it ends
the step (train/world.py `beat`). The launcher reads them for its live ranks (the local one by
pid; under SLURM the supervisor reads every beat in the shared run directory, `watch`). A rank
waiting in the collective is never the one named while a rank that has not reached it exists:
once the ranks waiting in it have waited the stall deadline S (plan/timeouts.py) on ranks that
have not come, the one furthest behind of those is the stopped one (`stalled`); and when no rank
made progress for the hang deadline, the rank furthest behind that is not waiting (the lowest
step and phase, the oldest beat) is the hung one (when every rank waits, none is named: a peer
cut off inside the collective is the coordinator's collective bound's, `in_collective`): it is named, its every thread's
Python stack is dumped into its log (SIGUSR1, faulthandler; train/worker.py) and its node is
treated as lost. A rank that ends with an error of its own says so (phase `crashed`,
train/world.crashed_beat; `crashed`). The deadline comes from the
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
    ended: bool  # the step's end (else its beginning, or its wait)
    time: float
    rank: int = -1  # the global rank in its attempt's plan
    host: str = ""  # the host it runs on (SLURMD_NODENAME under SLURM)
    task: int = -1  # its SLURM task id (its log is rank<task>.log); -1 outside SLURM
    waiting: bool = False  # in the step's cross-copy collective, waiting on the other copies
    crashed: bool = False  # it ended with an error of its own (train/world.crashed_beat), not a peer's


def read(run_dir: Path, pids=None) -> dict[int, Beat]:
    """The last beat of every rank that wrote one (of `pids` only, when given), by pid; the
    ranks write them in the run directory, so a supervisor on another node reads them too."""
    d = Path(run_dir) / rundir.PROGRESS
    out = {}
    for f in d.glob("*") if d.exists() else ():
        try:
            step, phase, t, pid, rank, host, task = f.read_text().split()
            b = Beat(int(pid), int(step), phase == "end", float(t), int(rank), host, int(task), phase == "wait",
                     phase == "crashed")
        except (OSError, ValueError):  # gone, or being written
            continue
        if pids is None or b.pid in pids:
            out[b.pid] = b
    return out


def _behind(b: Beat) -> tuple:
    """Furthest behind first: a rank waiting on the others last, then the lowest step and phase, the oldest beat."""
    return (b.waiting, b.step, b.ended, b.time)


def stalled(beats: dict[int, Beat], now: float, stall: float) -> Beat | None:
    """The rank that stopped while others wait on it: ranks have waited in the cross-copy collective
    of step s for `stall` seconds, and a rank has not reached it (its last beat is before that wait:
    a lower step, or step s begun); the one furthest behind of those. None while nobody waits that long."""
    waits = [b for b in beats.values() if b.waiting]
    if not waits:
        return None
    step = max(b.step for b in waits)
    since = min(b.time for b in waits if b.step == step)  # the first to wait in step s's collective
    if now - since < stall:
        return None
    behind = [b for b in beats.values() if not b.waiting and (b.step < step or (b.step == step and not b.ended))]
    return min(behind, key=_behind) if behind else None


def hung(beats: dict[int, Beat], now: float, deadline: float, stall: float | None = None) -> Beat | None:
    """The stopped rank (`stalled`, once its peers waited `stall` on it), or the rank furthest behind
    once no rank made progress for `deadline` seconds (a waiting rank never before one that is not)."""
    if not beats:
        return None
    if stall is not None:
        late = stalled(beats, now, stall)
        if late is not None:
            return late
    if now - max(b.time for b in beats.values()) < deadline:
        return None
    stopped = [b for b in beats.values() if not b.waiting]
    # every rank waits in the cross-copy collective: none stopped before it (a peer cut off inside it):
    # nobody is named; the collective's timeout is the last resort
    return min(stopped, key=_behind) if stopped else None


def watch(run_dir: Path, deadline: float, lost=(), now: float | None = None, stall: float | None = None,
          beats: dict | None = None) -> Beat | None:
    """The hung rank, for a supervisor that sees only the beats (SLURM: the ranks run on other
    nodes): every beat (`beats`: as read already) but those of hosts already lost (their ranks died
    with them; a rank that ended well removed its own), by `hung`."""
    beats = {p: b for p, b in (read(run_dir) if beats is None else beats).items() if b.host not in lost}
    return hung(beats, time.time() if now is None else now, deadline, stall)


def in_collective(beats: dict[int, Beat], now: float) -> tuple[int, float] | None:
    """(step, waited_s): every rank beats `wait` in the same step s (all are in its cross-copy
    collective or its commit), the last of them entered `waited_s` ago; None otherwise (a rank not
    there yet is a straggler's or a hang's, `stalled` / `hung`). The coordinator judges it against
    the collective's bound (launch/control.Coordinator.in_collective): a partition nobody sees."""
    if not beats or not all(b.waiting for b in beats.values()):
        return None
    steps = {b.step for b in beats.values()}
    if len(steps) != 1:
        return None
    return steps.pop(), now - max(b.time for b in beats.values())


def crashed(run_dir: Path, lost=()) -> Beat | None:
    """A rank that said it ended with an error of its own (its node is up: its process ended), the
    first to say so; None when none did."""
    beats = [b for b in read(run_dir).values() if b.crashed and b.host not in lost]
    return min(beats, key=lambda b: b.time) if beats else None


def verdict(beat: Beat, who: str, node, now: float, deadline: float, log: str, stall: float | None = None) -> str:
    """What the console, status and failover.json say of a hung rank (named at the stall deadline when
    its peers waited on it that long, else at the hang deadline)."""
    quiet = now - beat.time
    why = (f"its peers waited on it in the cross-copy collective past the stall deadline of {stall:.0f} s"
           if stall is not None and quiet < deadline else
           f"no rank made progress for {quiet:.1f} s, past the deadline of {deadline:.0f} s")
    return (f"{who} (pid {beat.pid}) on node {node} hung: {why}, and it is furthest behind (step {beat.step + 1} "
            f"{'ended' if beat.ended else 'waiting on the others' if beat.waiting else 'begun'}, {quiet:.1f} s ago); "
            f"its Python stack is in {log}; node {node} treated as lost")


def clear(run_dir: Path) -> None:
    """Forget the beats of an attempt that ended (their pids are gone)."""
    d = Path(run_dir) / rundir.PROGRESS
    for f in d.glob("*") if d.exists() else ():
        try:
            os.unlink(f)
        except OSError:
            pass
