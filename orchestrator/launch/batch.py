"""What the SLURM job runs: its supervisor in the batch step, and a standby that takes over
when the supervisor's node dies.

`BatchJob` (submitted by launch/slurm.py with submitit, run directly in the batch step on the
allocation's first node) claims the run's lease (launch/lease.py), renews it every
L / LEASE_RENEWALS on a thread, and runs the failover loop with srun steps (srun.resume). With
more than one node it also starts a standby supervisor, an srun step of one task on the
allocation's last node (srun.start_standby; `python -m orchestrator.launch.batch RUN_DIR`, its log
RUN_DIR/logs/standby.log); when the standby's step ends while the run goes on (its node died), the
supervisor starts another on the next node of the allocation (lease.Standby, looked at every renewal). The standby looks at the lease as often as it is renewed; when it has
not been renewed for L (failover.lease_s) the first node is taken to be gone (the supervisor, the
coordinator and the job's store with it) and the standby takes over in the same allocation,
without a requeue (`take_over`):

1. it claims the next generation of the lease (fencing: a holder that comes back steps down at
   its next renewal, stops its step and stands by in its turn: two supervisors never act at once);
2. it cancels the job's other steps (the ranks on the survivors wait on dead peers; the snapshot
   keepers' step is kept: the survivors' keepers hold the run's memory snapshots) and leaves the
   old holder's node out (SLURM, with --no-kill, takes it out of the allocation when it marks it down);
3. it resumes the run through the path a job takes after its supervisor died (srun.resume: the
   latest attempt's plan, re-planned on the survivors when they are fewer than it needs), from the
   newest memory snapshot the surviving keepers hold when it is newer than the last complete
   checkpoint, else from the checkpoint (srun.takeover_point);
   A takeover restarts the ranks: it counts against failover.max_failovers(_per_hour) like a
   restart, and when that budget is spent the standby stops the run instead (`refuse_takeover`);
4. failover.json records a `supervisor_takeover` event: who took over, from whom, on which node,
   the lease's age when it did (seconds.detection) and how long until the ranks could start
   again (seconds.takeover), and where it resumed (resumed_from, resumed_from_step; snapshot_not_used: why not
   from a snapshot).

When the run ends under the standby it ends the job (scancel: the batch step is on the lost node
and would hold the allocation until its time limit), or requeues it on a stop request. Every wait
is bounded: one look per renewal period, for as long as the job lives (its time limit). A
single-node job has no standby: losing its node ends it, and SLURM requeues it (--requeue; the
requeued job's supervisor records `supervisor_lost` and resumes from the last checkpoint).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from orchestrator import rundir
from orchestrator.launch import failover, sbatch, srun
from orchestrator.launch.lease import Lease, for_run, me
from orchestrator.rundir import EXIT_STOPPED, events
from orchestrator.launch.runs import DONE
from orchestrator.launch.status import read_status, write_status
from orchestrator.plan.timeouts import lease_period_s



def watch(lease: Lease, run_dir: Path, period_s: float, sleep=time.sleep) -> int | None:
    """Look at the lease every `period_s` until its holder has not renewed it for its timeout (the
    generation claimed then: take over after it) or the run ended under it (None). Bounded by the
    job's own time limit."""
    while True:
        held, claimed = lease.read(), lease.claimed()
        if held.get("released") or read_status(run_dir).get("state") in DONE:
            return None
        if lease.expired(held):
            return claimed
        sleep(period_s)


def stand_by(spec, run_dir: Path, lease: Lease | None = None) -> int:
    """Stand by until the run ends (0) or the holder is lost; then take over and supervise."""
    lease = lease or for_run(spec, run_dir)
    period = lease_period_s(lease.timeout_s)
    while (expired := watch(lease, run_dir, period)) is not None:
        held = lease.read()
        if lease.acquire(after=expired):
            return take_over(spec, run_dir, lease, held)
        time.sleep(period)  # another standby claimed it first: watch the new holder
    return rundir.EXIT_OK


def take_over(spec, run_dir: Path, lease: Lease, held: dict) -> int:
    """This standby holds the lease now: end the old steps, leave the old node out, resume."""
    t0, detected = time.time(), lease.age_s(held)
    job, mine = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_STEP_ID")
    print(f"TAKEOVER: {held.get('holder')} on {held.get('host')} has not renewed the lease for {detected:.1f} s "
          f"(timeout {lease.timeout_s:g} s); {lease.holder} takes over as generation {lease.generation}", flush=True)
    cancel_steps(job, keep=mine)
    dead = held.get("host")
    refused = refuse_takeover(run_dir)
    if refused is not None:  # the budget is spent: a supervisor lost is one more restart of the ranks
        events.record(run_dir, {"mode": "supervisor_takeover_refused", "by": lease.holder, "from": held.get("holder"),
                                "node": dead, "generation": lease.generation, "reason": refused})
        write_status(run_dir, state="failed", message=f"the standby supervisor {lease.holder} did not take over: "
                     f"{refused}")
        print(f"STOPPED: the standby does not take over: {refused}", flush=True)
        lease.release()
        end_job(rundir.EXIT_FAILED)
        return rundir.EXIT_FAILED
    nodes = [n for n in srun.hostnames(os.environ["SLURM_JOB_NODELIST"]) if n != dead]

    def started(plan, first_attempt: int, point: dict) -> None:  # the ranks start again: the event says how
        events.record(run_dir, {"mode": "supervisor_takeover", "by": lease.holder, "host": lease.host,  # long it took
                                "from": held.get("holder"), "node": dead, "nodes_excluded": [dead],
                                "generation": lease.generation, "lease_s": lease.timeout_s, "job_id": job,
                                "attempt": first_attempt, "layout": plan.layout.label(), "nodes_in_service": nodes,
                                "resumed_from": point["source"], "resumed_from_step": point["step"],
                                "failed_after_step": point.get("failed_after_step"),
                                **({"snapshot_not_used": point["why"]} if point.get("why") else {}),
                                "seconds": {"detection": detected, "takeover": time.time() - t0}})
    code = srun.resume(run_dir, nodes, lease, takeover=started)
    if code == rundir.EXIT_STOPPED:  # every rank saved on request (preemption, time limit): come back
        srun.requeue_or_stop(run_dir, spec.launcher)
    elif code != rundir.EXIT_FENCED:
        end_job(code)
    return code


def refuse_takeover(run_dir: Path, now: float | None = None) -> str | None:
    """Why this takeover would exceed failover.max_failovers(_per_hour) (None: it does not): a
    takeover restarts the ranks, and counts against the budget as a restart does (its
    `supervisor_takeover` event; failover.over_budget)."""
    from orchestrator.launch.runs import load_plan

    return failover.over_budget(load_plan(run_dir), events.read_events(run_dir), now)


def cancel_steps(job: str, keep: str | None) -> None:
    """scancel every step of `job` but `keep` (this standby's), the batch step (ending it would end the
    job) and the snapshot keepers' (sbatch.KEEPER_STEP: the survivors' hold the run's snapshots)."""
    if not job:
        return
    try:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i %j"], capture_output=True, text=True,
                             timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        out = []
    steps = [s for s, name in (f"{line} ".split(" ", 1) for line in out) if name.strip() != sbatch.KEEPER_STEP
             and "." in s and s.split(".", 1)[1].isdigit() and s.split(".", 1)[1] != keep]
    for s in steps:
        subprocess.run(["scancel", s], capture_output=True, timeout=30, check=False)
    if steps:
        print(f"cancelled the old step(s) {', '.join(steps)}", flush=True)


def end_job(code: int) -> None:
    """The run ended under the standby: end the allocation (its batch step is on the lost node)."""
    job = os.environ.get("SLURM_JOB_ID")
    print(f"the run ended with status {code} under the standby supervisor {me()}; ending job {job}", flush=True)
    if job:
        subprocess.run(["scancel", job], capture_output=True, timeout=60, check=False)


class BatchJob:
    """What the SLURM job runs (pickled by submitit): supervise the run in `run_dir` with
    the allocation SLURM gave, from wherever an earlier job of this run left it."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.workers: srun.SrunWorkers | None = None

    def __call__(self) -> int:
        run_dir = Path(self.run_dir)
        given = srun.hostnames(os.environ["SLURM_JOB_NODELIST"])
        left_out = failover.excluded_nodes(events.read_events(run_dir))  # drained or flapping earlier in the run
        nodes = [n for n in given if n not in left_out]
        if left_out and len(nodes) < len(given):
            print(f"left out of this job's steps: {sorted(set(given) - set(nodes))} (drained or flapping: "
                  f"failed {failover.FLAP_FAILURES} times within {failover.FLAP_WINDOW_S:.0f} s)", flush=True)
        spec = srun.plan_for(run_dir, nodes).spec
        lease = for_run(spec, run_dir)
        for _ in range(10):  # one batch step per job: a claim lost is a standby's of a job before this one
            if lease.acquire():
                break
        else:
            raise RuntimeError(f"could not claim the run's lease in {run_dir / rundir.LEASE}")
        # with more than one node a standby on the last one takes over if this node dies (srun.start_standby)
        code = srun.resume(run_dir, nodes, lease, job=self, standby_on=nodes[-1] if len(nodes) > 1 else None)
        if code == rundir.EXIT_FENCED:  # this node came back after a standby took over: stand by in turn
            print("FENCED: a standby supervisor took the run's lease; this one steps down and stands by", flush=True)
            code = stand_by(spec, run_dir)
        return self._end(code, spec.launcher)

    def _end(self, code: int, lc) -> int:
        """How the job ends, as SLURM records it. 0: COMPLETED. EXIT_STOPPED (every rank saved on
        request: preemption, time limit): requeued, to resume from that checkpoint. Any other code
        (a failure, no progress, steps missing) ends the batch step with it, so SLURM records the job
        FAILED with that exit code and does not requeue it: returned, submitit would record it as a
        successful result and the job as COMPLETED 0:0. SystemExit is not an Exception, so
        submitit's job runner (submitit.core.submission.process_job, `except Exception`) lets it
        through and the process exits with the code; no result is pickled (nothing reads one)."""
        if code == EXIT_STOPPED:  # every rank saved on request (preemption, time limit): come back
            srun.requeue_or_stop(Path(self.run_dir), lc)
            return code
        if code:
            print(f"the supervisor ends the job with exit status {code} (not requeued)", flush=True)
            sys.exit(code)
        return code

    def checkpoint(self, *args, **kwargs):
        """Preemption or time limit signalled to this batch step (submitit calls this on USR2):
        let every rank save at its next step boundary, then requeue the job."""
        from orchestrator.launch.runs import load_plan

        lc = load_plan(Path(self.run_dir)).spec.launcher
        if self.workers is not None and self.workers.proc is not None:
            self.workers.stop_requested = True
            self.workers.signal(signal.SIGUSR2)
            deadline = time.monotonic() + max(lc.signal_delay_s - 10, 10)
            while self.workers.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
        srun.requeue_or_stop(Path(self.run_dir), lc)


def main(argv: list[str] | None = None) -> int:
    from orchestrator.launch.runs import load_plan

    run_dir = Path((argv or sys.argv[1:])[0])
    log = open(rundir.log_file(run_dir, "standby"), "a", buffering=1)  # its own log, not through its srun,
    os.dup2(log.fileno(), 1)  # which lives on the first node and dies with it (the steps it starts inherit it)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    print(f"standby supervisor {me()} watching {run_dir / rundir.LEASE}", flush=True)
    return stand_by(load_plan(run_dir, latest=False).spec, run_dir)


if __name__ == "__main__":
    sys.exit(main())
